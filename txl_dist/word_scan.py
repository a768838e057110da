"""The whitespace-separated words of UTF-8 text, found with numpy instead of one Python object per word.

Python's ``str.split()`` costs about 70 ns and a new object per word; One Billion Word has 0.8B of them. Here
the words of a chunk of bytes are located by comparisons over all its bytes at once (a word starts where a
non-whitespace byte follows whitespace), and a word of at most 8 bytes is identified by its bytes read as one
big-endian 64-bit integer, its *packed key* (the bytes after the word are masked off). Such keys are exact: no
two different words of at most 8 bytes without NUL share one, and no key is 0. Counting and vocabulary lookups
then work on arrays of keys (`count_keys`, `PackedVocabulary`); the few longer words go through Python.

The result equals ``str.split()`` on the decoded text only for text that `scan_lines` accepts: valid UTF-8
without NUL bytes, carriage returns or non-ASCII whitespace (U+00A0, U+2028, ...). For anything else it returns
None and callers take the ``str`` path. Documents are lines (``\\n`` only, as in `data_tools.corpora.text_decoding`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

PACKED_BYTES = 8
# Masks that keep the first n bytes of a big-endian 64-bit key, n = 0..8.
_KEEP = np.array([0] + [((1 << (8 * n)) - 1) << (8 * (8 - n)) for n in range(1, 9)], dtype=np.uint64)


@dataclasses.dataclass
class LineWords:
    """The words of a chunk of text whose lines are documents."""

    data: bytes
    starts: np.ndarray
    """Byte offset of each word (int64)."""
    lengths: np.ndarray
    """Bytes of each word (int64)."""
    words_per_line: np.ndarray
    """Words of each line (int64), a last line without ``\\n`` included; lines without words count 0."""
    line_ends: np.ndarray
    """Byte offset of each line's end (its ``\\n``, or the end of the data)."""
    ascii: bool

    def characters_per_line(self) -> np.ndarray:
        """Code points of each line, its ``\\n`` excluded."""
        line_starts = np.concatenate([[0], self.line_ends[:-1] + 1])
        characters = self.line_ends - line_starts
        if not self.ascii:  # a code point is a byte that is not a UTF-8 continuation byte (0x80-0xBF)
            codes = np.frombuffer(self.data, dtype=np.uint8)
            continuations = np.flatnonzero((codes - np.uint8(0x80)) < 0x40)
            characters -= np.bincount(np.searchsorted(self.line_ends, continuations), minlength=len(characters))
        return characters

    def short(self) -> np.ndarray:
        """Which words fit a packed key (at most 8 bytes)."""
        return self.lengths <= PACKED_BYTES

    def packed_keys(self, which: np.ndarray | None = None) -> np.ndarray:
        """Packed keys (uint64) of the words selected by ``which`` (a boolean mask or indices; default: every
        word), which must all be short."""
        starts, lengths = self.starts, self.lengths
        if which is not None:
            starts, lengths = starts[which], lengths[which]
        if len(lengths) and lengths.max() > PACKED_BYTES:
            raise ValueError(f"a word of {int(lengths.max())} bytes has no packed key (at most {PACKED_BYTES})")
        padded = self.data + bytes(PACKED_BYTES)
        # Element i of this view is the 8 bytes from offset i on, read big-endian.
        windows = np.ndarray(shape=(len(self.data),), dtype=">u8", buffer=padded, strides=(1,))
        return windows[starts].astype(np.uint64) & _KEEP[lengths]

    def words(self, which: np.ndarray) -> list[bytes]:
        """The bytes of the words at indices ``which``."""
        data = self.data
        return [
            data[start : start + length]
            for start, length in zip(self.starts[which].tolist(), self.lengths[which].tolist())
        ]


def scan_lines(data: bytes) -> LineWords | None:
    """Locate the words and lines of ``data``; None when it needs the ``str`` path (see the module docstring)."""
    is_ascii = data.isascii()
    if b"\0" in data or b"\r" in data:
        return None
    if not is_ascii:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    codes = np.frombuffer(data, dtype=np.uint8)
    if not is_ascii and _has_non_ascii_space(codes):
        return None
    space = np.empty(len(codes) + 2, dtype=bool)
    space[0] = space[-1] = True
    space[1:-1] = _is_space(codes)
    # Changes between whitespace and word, in data coordinates: word starts and word ends alternate.
    edges = np.flatnonzero(space[1:] != space[:-1])
    starts, ends = edges[0::2], edges[1::2]
    line_ends = np.flatnonzero(codes == 0x0A)
    if not len(codes) or codes[-1] != 0x0A:  # a last line without "\n" (as str.split("\n") sees it)
        line_ends = np.append(line_ends, len(codes))
    words_per_line = np.diff(np.searchsorted(starts, line_ends), prepend=0)
    return LineWords(data, starts, ends - starts, words_per_line, line_ends, is_ascii)


def _is_space(codes: np.ndarray) -> np.ndarray:
    """Which bytes are ASCII characters that str.split() treats as whitespace: \\t \\n \\v \\f \\r (9-13), the
    separators \\x1c-\\x1f (28-31) and the space (comparisons: faster than a lookup table)."""
    # uint8 arithmetic wraps: codes - 9 <= 4 holds exactly for 9 <= codes <= 13.
    return (codes == 0x20) | ((codes - np.uint8(9)) <= 4) | ((codes - np.uint8(28)) <= 3)


def _has_non_ascii_space(codes: np.ndarray) -> bool:
    """Whether valid UTF-8 ``codes`` hold a non-ASCII character that str.split() treats as whitespace: U+0085,
    U+00A0 (C2 85, C2 A0), U+1680 (E1 9A 80), U+2000-U+200A, U+2028, U+2029, U+202F (E2 80 xx), U+205F
    (E2 81 9F) or U+3000 (E3 80 80). Candidates are the bytes C2-E3, then their next two bytes are checked (a
    regular expression for the same runs at a tenth of the speed)."""
    leads = np.flatnonzero((codes >= 0xC2) & (codes <= 0xE3))
    if not len(leads):
        return False
    padded = np.concatenate([codes, np.zeros(2, dtype=np.uint8)])
    lead, second, third = codes[leads], padded[leads + 1], padded[leads + 2]
    found = (lead == 0xC2) & ((second == 0x85) | (second == 0xA0))
    found |= (lead == 0xE1) & (second == 0x9A) & (third == 0x80)
    found |= (lead == 0xE2) & (second == 0x80) & ((third <= 0x8A) | (third == 0xA8) | (third == 0xA9) | (third == 0xAF))
    found |= (lead == 0xE2) & (second == 0x81) & (third == 0x9F)
    found |= (lead == 0xE3) & (second == 0x80) & (third == 0x80)
    return bool(found.any())


def count_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys in ascending order, how often each occurs)."""
    return np.unique(keys, return_counts=True)


def merge_counts(keys: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Several (keys, counts) pairs as one: distinct keys ascending, counts summed."""
    if not keys or not any(len(part) for part in keys):
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    all_keys, all_counts = np.concatenate(keys), np.concatenate(counts).astype(np.int64)
    order = np.argsort(all_keys, kind="stable")
    all_keys, all_counts = all_keys[order], all_counts[order]
    firsts = np.flatnonzero(np.concatenate([[True], all_keys[1:] != all_keys[:-1]]))
    return all_keys[firsts], np.add.reduceat(all_counts, firsts)


def unpack_keys(keys: np.ndarray) -> list[bytes]:
    """The words of packed keys."""
    # numpy's fixed-width bytes drop trailing NULs, which is exactly the padding of a packed key.
    return np.asarray(keys, dtype=">u8").view("S8").tolist()


class PackedVocabulary:
    """Word -> id for a whole vocabulary, looked up for arrays of words at once.

    Words of at most 8 bytes live in an open-addressing hash table of packed keys (linear probing, at most half
    full, built with numpy); longer ones in a dict. Ids are those of ``words``; a word outside the vocabulary
    gets ``missing``.
    """

    def __init__(self, words: list[str], missing: int):
        self.missing = missing
        encoded = [word.encode("utf-8") for word in words]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        # NUL inside a word would make its packed key ambiguous; such words go to the dict.
        short = (lengths <= PACKED_BYTES) & np.fromiter(
            (b"\0" not in w for w in encoded), dtype=bool, count=len(encoded)
        )
        self.long = {encoded[i]: i for i in np.flatnonzero(~short).tolist()}
        short_ids = np.flatnonzero(short)
        joined = b" ".join(encoded[i] for i in short_ids.tolist())
        padded = joined + bytes(PACKED_BYTES)
        starts = np.concatenate([[0], np.cumsum(lengths[short_ids] + 1)[:-1]]).astype(np.int64)
        windows = np.ndarray(shape=(len(joined),), dtype=">u8", buffer=padded, strides=(1,))
        keys = (
            windows[starts].astype(np.uint64) & _KEEP[lengths[short_ids]]
            if len(short_ids)
            else np.zeros(0, dtype=np.uint64)
        )
        bits = max(4, int(2 * max(len(keys), 1) - 1).bit_length())
        self._shift = np.uint64(64 - bits)
        self._mask = np.int64((1 << bits) - 1)
        self.table_keys = np.zeros(1 << bits, dtype=np.uint64)
        self.table_ids = np.zeros(1 << bits, dtype=np.int64)
        slots = self._home(keys)
        pending = np.arange(len(keys))
        while len(pending):
            free = self.table_keys[slots[pending]] == 0
            candidates = pending[free]
            taken, first = np.unique(slots[candidates], return_index=True)
            winners = candidates[first]
            self.table_keys[taken] = keys[winners]
            self.table_ids[taken] = short_ids[winners]
            placed = np.zeros(len(keys), dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            slots[pending] = (slots[pending] + 1) & self._mask

    def _home(self, keys: np.ndarray) -> np.ndarray:
        # Fibonacci hashing: the top bits of key * 2^64 / golden ratio.
        with np.errstate(over="ignore"):
            return ((keys * np.uint64(0x9E3779B97F4A7C15)) >> self._shift).astype(np.int64)

    def lookup_keys(self, keys: np.ndarray) -> np.ndarray:
        """Ids (int64) of packed keys."""
        slots = self._home(keys)
        found = self.table_keys[slots]
        hit = found == keys
        ids = np.where(hit, self.table_ids[slots], self.missing)
        # The rest probe on: a key not in its home slot, until it is found or an empty slot says it is absent.
        active = np.flatnonzero(~hit & (found != 0))
        while len(active):
            slots[active] = (slots[active] + 1) & self._mask
            found = self.table_keys[slots[active]]
            hit = found == keys[active]
            ids[active[hit]] = self.table_ids[slots[active[hit]]]
            active = active[~hit & (found != 0)]
        return ids

    def lookup(self, scan: LineWords) -> np.ndarray:
        """Ids (int64) of every word of a scanned chunk, in order."""
        short = scan.short()
        ids = np.empty(len(scan.starts), dtype=np.int64)
        ids[short] = self.lookup_keys(scan.packed_keys(short))
        long_words = np.flatnonzero(~short)
        if len(long_words):
            get, missing = self.long.get, self.missing
            ids[long_words] = [get(word, missing) for word in scan.words(long_words)]
        return ids
