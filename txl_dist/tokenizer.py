"""The one tokenizer interface of txl_dist: load a tokenizer directory, encode, decode, special ids.

A tokenizer directory (written by ``python -m data_tools.train_tokenizer``) holds the tokenizer's files and
``tokenizer.json``::

    {"kind": "sentencepiece" | "word" | "byte" | "char", "vocab_size": 32000, "files": ["spm.model"],
     "fingerprint": "<sha256>", "eos_id": 2, "eod_id": 4, "unk_id": 0,
     "pieces": {"eos": "</s>", "eod": "<eod>", "unk": "<unk>"}, "training": {...settings, for the record...}}

- ``sentencepiece``: ``spm.model``, a SentencePiece model (unigram or BPE). ``eos_id`` is its ``</s>``; ``eod_id``
  is a user-defined end-of-document symbol when one was trained, else ``eos_id``.
- ``word``: ``vocab.txt``, one ``token<TAB>count`` line per id (specials first, then words by descending count).
  Text is split on whitespace (Python's ``str.split()``); a word outside the vocabulary becomes ``unk_id``.
  Decoding joins the words with single spaces.
- ``byte``: ``bytes.txt``, 256 lines ``<0xHH><TAB>count``: id = the byte's value, every byte one id (enwik8,
  which is raw XML bytes, some of them not UTF-8). ``eos_id = eod_id = 10``, the newline byte: a line of the
  input is its bytes followed by its newline, so a file's token stream is exactly its bytes (plus one newline
  when the file does not end with one, the authors' final ``<eos>``). Text in and out is ``str`` holding the
  bytes as UTF-8 with ``surrogateescape`` (bytes that are not UTF-8 are lone surrogates U+DC80..U+DCFF), so that
  ``decode(encode(text)) == text`` for every byte string; `ByteTokenizer.encode_bytes`/`decode_bytes` take bytes.
- ``char``: ``chars.txt``, one line ``U+XXXX<TAB>count`` per id: every character of the alphabet one id (text8's
  27). Id 0 is the newline, ``eos_id = eod_id``, which ends every line as for bytes; there is no unknown token:
  a character outside the alphabet is an error naming it.

The fingerprint is the sha256 of the bytes of ``files`` in their listed order; with one file (both kinds) it is
exactly ``sha256sum`` of that file. Shards record it, and readers refuse shards built with another tokenizer.

Documents. A document is a list of lines. Its tokens are each line's tokens followed by ``eos_id``, except that
the last line is followed by ``eod_id`` instead. A document of one line (a PTB or One Billion Word sentence) is
therefore its tokens and one separator, and with ``eod_id == eos_id`` every line ends in ``eos_id``. Newlines thus
stay meaningful for SentencePiece, whose normaliser would otherwise fold them into spaces.
"""

from __future__ import annotations

import abc
import functools
import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from txl_dist.fileio import atomic_write_text, sha256_files

if TYPE_CHECKING:
    from txl_dist.word_scan import LineWords, PackedVocabulary

TOKENIZER_JSON = "tokenizer.json"
KINDS = ("sentencepiece", "word", "byte", "char")
CHARACTER_KINDS = ("byte", "char")
"""Kinds whose every token is one character (a byte for ``byte``): their loss per token is bits per character."""
SENTENCEPIECE_MODEL = "spm.model"
WORD_VOCAB = "vocab.txt"
BYTE_VOCAB = "bytes.txt"
CHAR_VOCAB = "chars.txt"
NEWLINE = 10


class TokenizerError(ValueError):
    """A tokenizer directory that is missing, damaged or inconsistent; the message names the file."""


def fingerprint_files(directory: str | os.PathLike, files: Sequence[str]) -> str:
    """sha256 of the bytes of ``files`` (names relative to ``directory``) in the order given."""
    paths = [Path(directory) / name for name in files]
    try:
        return sha256_files(paths)
    except OSError as error:
        raise TokenizerError(f"{error.filename}: cannot read tokenizer file ({error.strerror})") from error


class Tokenizer(abc.ABC):
    """What the rest of the system sees of a tokenizer. Create one with `load_tokenizer`."""

    kind: str
    character_level: bool = False
    """Every token is one character (or byte): the loss per token in bits is the bits per character."""

    def __init__(
        self,
        directory: Path,
        files: list[str],
        fingerprint: str,
        vocab_size: int,
        eos_id: int,
        eod_id: int,
        unk_id: int | None,
    ):
        self.directory = directory
        self.files = files
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.eod_id = eod_id
        self.unk_id = unk_id

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of one line (or any text); no separator is appended."""

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        """`encode` of each line; subclasses make it faster than a loop."""
        return [self.encode(line) for line in lines]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (the inverse of `encode` up to normalisation)."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id."""

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token stream of documents given as lists of lines (see the module docstring).

        Returns ``(tokens, tokens_per_document)``: the documents' tokens one after another, separators included,
        as one array of ``dtype``, and how many of them belong to each document.
        """
        lines_per_document = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        if len(documents) and lines_per_document.min() == 0:
            raise ValueError("a document needs at least one line")
        encoded = self.encode_batch([line for document in documents for line in document])
        if len(encoded) == len(documents):  # one line each (PTB, One Billion Word): the fast path
            for line_ids in encoded:
                line_ids.append(self.eod_id)
        else:
            last_lines = np.cumsum(lines_per_document) - 1
            for line_ids in encoded:
                line_ids.append(self.eos_id)
            for last_line in last_lines.tolist():
                encoded[last_line][-1] = self.eod_id
        tokens = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=sum(map(len, encoded)))
        line_tokens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        if len(encoded) == len(documents):
            return tokens, line_tokens
        return tokens, np.add.reduceat(line_tokens, np.cumsum(lines_per_document) - lines_per_document)

    def encode_document(self, text: str) -> list[int]:
        """Ids of a document given as text: its lines are the pieces between ``\\n`` characters."""
        return self.encode_documents([text.split("\n")])[0].tolist()

    def decode_document(self, ids: Sequence[int]) -> str:
        """Text of a document's ids: lines end at ``eos_id``/``eod_id`` and are joined with ``\\n``."""
        lines, line = [], []
        for token_id in ids:
            if token_id in (self.eos_id, self.eod_id):
                lines.append(self.decode(line))
                line = []
            else:
                line.append(token_id)
        if line:
            lines.append(self.decode(line))
        return "\n".join(lines)

    def identity(self) -> dict[str, Any]:
        """The fields of `txl_dist.data.format.TokenizerIdentity`."""
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
            "eos_id": self.eos_id,
            "eod_id": self.eod_id,
            "unk_id": self.unk_id,
        }

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.directory)!r}, vocab_size={self.vocab_size}, "
            f"eos_id={self.eos_id}, eod_id={self.eod_id}, unk_id={self.unk_id})"
        )


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (``spm.model``)."""

    kind = "sentencepiece"

    def __init__(
        self,
        directory: Path,
        files: list[str],
        fingerprint: str,
        vocab_size: int,
        eos_id: int,
        eod_id: int,
        unk_id: int | None,
    ):
        import sentencepiece

        super().__init__(directory, files, fingerprint, vocab_size, eos_id, eod_id, unk_id)
        path = directory / files[0]
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:
            raise TokenizerError(f"{path}: not a valid SentencePiece model ({error})") from error
        self._entries = self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        # One thread: build_shards parallelises over processes; more threads here would oversubscribe the cores.
        return self._processor.encode(list(lines), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        for token_id in ids:
            self._check_id(token_id)
        return self._processor.decode(ids)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return self._processor.id_to_piece(int(token_id))


class WordTokenizer(Tokenizer):
    """Whitespace-separated words looked up in ``vocab.txt``."""

    kind = "word"

    def __init__(
        self,
        directory: Path,
        files: list[str],
        fingerprint: str,
        vocab_size: int,
        eos_id: int,
        eod_id: int,
        unk_id: int | None,
    ):
        super().__init__(directory, files, fingerprint, vocab_size, eos_id, eod_id, unk_id)
        self.words, self.counts = read_word_vocab(directory / files[0])
        self._entries = len(self.words)

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        # Built on first use: a process that only needs the ids of the specials (the shard builder's parent)
        # skips a dict of a million words.
        return {word: token_id for token_id, word in enumerate(self.words)}

    @functools.cached_property
    def _packed(self) -> PackedVocabulary:
        from txl_dist.word_scan import PackedVocabulary

        return PackedVocabulary(self.words, missing=-1 if self.unk_id is None else self.unk_id)

    def encode(self, text: str) -> list[int]:
        lookup, unk_id = self._ids.get, self.unk_id
        ids = [lookup(word, unk_id) for word in text.split()]
        if unk_id is None and None in ids:
            self._raise_unknown(next(word for word in text.split() if word not in self._ids))
        return ids

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        if self.unk_id is None:
            return [self.encode(line) for line in lines]
        lookup, unk_id = self._ids.get, self.unk_id
        return [[lookup(word, unk_id) for word in line.split()] for line in lines]

    def encode_scanned_lines(self, scan: LineWords, dtype: np.dtype | type = np.int64) -> tuple[np.ndarray, np.ndarray]:
        """The token stream of the lines of a chunk scanned by `txl_dist.word_scan.scan_lines`, each non-empty
        line a document of one line: exactly ``encode_documents([[line] for line in lines if line.split()])``,
        at about three times its speed. Returns ``(tokens, tokens_per_document)``."""
        ids = self._packed.lookup(scan)
        if self.unk_id is None and len(ids) and ids.min() < 0:
            self._raise_unknown(scan.words(np.flatnonzero(ids < 0)[:1])[0].decode("utf-8"))
        words = scan.words_per_line[scan.words_per_line > 0]
        tokens_per_document = words + 1
        ends = np.cumsum(tokens_per_document) - 1  # where each document's eod_id goes
        tokens = np.empty(len(ids) + len(words), dtype=dtype)
        is_word = np.ones(len(tokens), dtype=bool)
        is_word[ends] = False
        tokens[is_word] = ids
        tokens[ends] = self.eod_id
        return tokens, tokens_per_document

    def _raise_unknown(self, word: str) -> None:
        raise ValueError(f"word {word!r} is not in {self.directory / self.files[0]} and it has no unk token")

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.id_to_piece(token_id) for token_id in ids)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return self.words[int(token_id)]


class ByteTokenizer(Tokenizer):
    """Every byte one id (its value); the newline byte ends lines and documents (see the module docstring)."""

    kind = "byte"
    character_level = True

    def __init__(
        self,
        directory: Path,
        files: list[str],
        fingerprint: str,
        vocab_size: int,
        eos_id: int,
        eod_id: int,
        unk_id: int | None,
    ):
        super().__init__(directory, files, fingerprint, vocab_size, eos_id, eod_id, unk_id)
        pieces, self.counts = read_word_vocab(directory / files[0])
        expected = [byte_piece(value) for value in range(256)]
        if pieces != expected:
            first = next((i for i, (a, b) in enumerate(zip(pieces, expected)) if a != b), min(len(pieces), 256))
            raise TokenizerError(
                f"{directory / files[0]}: line {first + 1} should be {expected[first]!r} "
                f"(256 lines <0x00> .. <0xFF>, one per byte value)"
                if first < 256
                else f"{directory / files[0]}: {len(pieces)} lines, expected 256 (<0x00> .. <0xFF>)"
            )
        if (eos_id, eod_id, unk_id) != (NEWLINE, NEWLINE, None):
            raise TokenizerError(
                f"{directory / TOKENIZER_JSON}: a byte tokenizer has eos_id = eod_id = 10 (the "
                f"newline byte) and unk_id null, got {eos_id}, {eod_id}, {unk_id}"
            )
        self._entries = len(pieces)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogateescape"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """The ids of raw bytes (uint8; one per byte, the newline included)."""
        return np.frombuffer(data, dtype=np.uint8)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() > 255):
            self._check_id(int(ids[(ids < 0) | (ids > 255)][0]))
        return ids.astype(np.uint8).tobytes()

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", "surrogateescape")

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        # Each line's bytes and its newline: the documents' lines joined, each ended, are exactly the stream.
        data = "".join(line + "\n" for document in documents for line in document).encode("utf-8", "surrogateescape")
        tokens = np.frombuffer(data, dtype=np.uint8).astype(dtype)
        lengths = [sum(len(line.encode("utf-8", "surrogateescape")) + 1 for line in document) for document in documents]
        return tokens, np.array(lengths, dtype=np.int64)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return byte_piece(int(token_id))


def byte_piece(value: int) -> str:
    """The vocabulary entry of a byte, as SentencePiece writes byte pieces: ``<0x0A>``."""
    return f"<0x{value:02X}>"


class CharTokenizer(Tokenizer):
    """Every character of an alphabet one id; id 0 is the newline, which ends lines and documents."""

    kind = "char"
    character_level = True

    def __init__(
        self,
        directory: Path,
        files: list[str],
        fingerprint: str,
        vocab_size: int,
        eos_id: int,
        eod_id: int,
        unk_id: int | None,
    ):
        super().__init__(directory, files, fingerprint, vocab_size, eos_id, eod_id, unk_id)
        path = directory / files[0]
        pieces, self.counts = read_word_vocab(path)
        characters = []
        for number, piece in enumerate(pieces, start=1):
            if not re.fullmatch(r"U\+[0-9A-F]{4,6}", piece) or int(piece[2:], 16) > 0x10FFFF:
                raise TokenizerError(f"{path}, line {number}: expected a code point U+XXXX, got {piece!r}")
            characters.append(chr(int(piece[2:], 16)))
        if not characters or characters[0] != "\n" or (eos_id, eod_id, unk_id) != (0, 0, None):
            raise TokenizerError(
                f"{path}: a character tokenizer has the newline U+000A as id 0 (eos_id = eod_id = 0, unk_id null)"
            )
        self.characters = characters
        self.is_space = np.array([c.isspace() for c in characters])
        """Per id: whitespace for ``str.split()``."""
        # Code point -> id (-1: not in the alphabet), one int32 per code point up to the largest of the alphabet.
        self._ids = np.full(max(map(ord, characters)) + 1, -1, dtype=np.int32)
        self._ids[[ord(c) for c in characters]] = np.arange(len(characters), dtype=np.int32)
        self._entries = len(characters)

    def encode_codes(self, codes: np.ndarray, where: str = "the text") -> np.ndarray:
        """Ids (int32) of code points; a character outside the alphabet is an error naming it."""
        inside = codes < len(self._ids)
        ids = self._ids[np.where(inside, codes, 0)] if not inside.all() else self._ids[codes]
        unknown = (ids < 0) | ~inside
        if unknown.any():
            first = int(np.flatnonzero(unknown)[0])
            raise ValueError(
                f"{where}: character {chr(int(codes[first]))!r} (U+{int(codes[first]):04X}, "
                f"character {first}) is not in the alphabet of {self.directory / self.files[0]}"
            )
        return ids

    def encode_text(self, text: str, where: str = "the text") -> np.ndarray:
        """`encode` as an int32 array, computed with numpy."""
        return self.encode_codes(_code_points(text), where)

    def encode(self, text: str) -> list[int]:
        return self.encode_text(text).tolist()

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        text = "".join(line + "\n" for document in documents for line in document)
        lengths = [sum(len(line) + 1 for line in document) for document in documents]
        return self.encode_text(text).astype(dtype), np.array(lengths, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.id_to_piece(token_id) for token_id in ids)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return self.characters[int(token_id)]


def _code_points(text: str) -> np.ndarray:
    """The code points of ``text``: uint8 for ASCII text (a quarter of the memory), else uint32."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def char_piece(character: str) -> str:
    """The vocabulary entry of a character: its code point, ``U+0061`` (whitespace has no other written form)."""
    return f"U+{ord(character):04X}"


def read_word_vocab(path: Path) -> tuple[list[str], list[int]]:
    """Words and counts of a ``vocab.txt`` (``token<TAB>count`` per line, the line number is the id)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TokenizerError(f"{path}: not UTF-8 text ({error})") from error
    except OSError as error:
        raise TokenizerError(f"{path}: cannot read word vocabulary ({error.strerror})") from error
    # Split on "\n" only: str.splitlines would also break at characters such as U+2028 (none can be inside a
    # word, but a damaged file should fail on its line number, not shift every id).
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    # The whole file at once (a million lines in a fraction of a second): split on whitespace, the fields
    # alternate word and count exactly when joining them back with tabs and newlines gives the text.
    fields = text.split()
    words, counts = fields[0::2], fields[1::2]
    if words and len(fields) == 2 * len(lines):
        rebuilt = "\n".join(map("\t".join, zip(words, counts)))
        if text in (rebuilt, rebuilt + "\n") and all(map(str.isdecimal, counts)) and len(set(words)) == len(words):
            return words, list(map(int, counts))
    return _read_word_vocab_lines(path, lines)


def _read_word_vocab_lines(path: Path, lines: list[str]) -> tuple[list[str], list[int]]:
    """`read_word_vocab` line by line, for the error that names the first bad line."""
    words, counts, seen = [], [], set()
    for number, line in enumerate(lines, start=1):
        word, tab, count = line.partition("\t")
        if not tab or not word or not count.isdecimal() or any(c.isspace() for c in word):
            raise TokenizerError(f"{path}, line {number}: expected 'token<TAB>count', got {line[:80]!r}")
        if word in seen:
            raise TokenizerError(f"{path}, line {number}: token {word!r} appears twice")
        seen.add(word)
        words.append(word)
        counts.append(int(count))
    if not words:
        raise TokenizerError(f"{path}: empty word vocabulary")
    return words, counts


def write_word_vocab(path: Path, words: Sequence[str], counts: Sequence[int]) -> None:
    atomic_write_text(path, "".join(f"{word}\t{count}\n" for word, count in zip(words, counts)))


_CLASSES = {cls.kind: cls for cls in (SentencePieceTokenizer, WordTokenizer, ByteTokenizer, CharTokenizer)}


def write_tokenizer_json(
    directory: str | os.PathLike,
    kind: str,
    files: list[str],
    vocab_size: int,
    eos_id: int,
    eod_id: int,
    unk_id: int | None,
    pieces: dict[str, str],
    training: dict[str, Any],
) -> Tokenizer:
    """Fingerprint the files, write ``tokenizer.json`` (atomically and last: it marks a complete directory) and
    load the result with the checks a user's `load_tokenizer` makes."""
    directory = Path(directory)
    description = {
        "kind": kind,
        "vocab_size": vocab_size,
        "files": files,
        "fingerprint": fingerprint_files(directory, files),
        "eos_id": eos_id,
        "eod_id": eod_id,
        "unk_id": unk_id,
        "pieces": pieces,
        "training": training,
    }
    atomic_write_text(directory / TOKENIZER_JSON, json.dumps(description, indent=1, ensure_ascii=False) + "\n")
    return load_tokenizer(directory)


def verified_fingerprint(directory: str | os.PathLike) -> str:
    """The fingerprint of a tokenizer directory, checked against its files (the checks of `load_tokenizer` up to
    the sha256), without reading the vocabulary into a tokenizer: 16 ms against 0.87 s for a 779k-word
    vocabulary. For a directory `load_tokenizer` has checked already; it does not check the description's
    vocabulary size and special ids against the vocabulary."""
    return _checked_description(directory)[5]


def _checked_description(directory: str | os.PathLike):
    """(directory, tokenizer.json path, its contents, a checked field reader, the files, their sha256), after
    checking the description's kind and files and that the files' sha256 is the recorded fingerprint."""
    directory = Path(directory)
    path = directory / TOKENIZER_JSON
    if not directory.is_dir():
        raise TokenizerError(f"{directory}: no such tokenizer directory")
    if not path.is_file():
        raise TokenizerError(f"{path}: missing; create a tokenizer with python -m data_tools.train_tokenizer")
    try:
        description = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(description, dict):
        raise TokenizerError(f"{path}: expected a JSON object")

    def field(key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in description:
            raise TokenizerError(f"{path}: missing key '{key}'")
        value = description[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise TokenizerError(f"{path}: key '{key}' has the wrong type ({type(value).__name__})")
        return value

    kind = field("kind", str)
    if kind not in _CLASSES:
        raise TokenizerError(f"{path}: key 'kind' is {kind!r}, expected one of {list(KINDS)}")
    files = field("files", list)
    if len(files) != 1 or not isinstance(files[0], str) or Path(files[0]).name != files[0]:
        raise TokenizerError(f"{path}: key 'files' must list one file name of the directory, got {files!r}")
    for name in files:
        if not (directory / name).is_file():
            raise TokenizerError(f"{directory / name}: missing tokenizer file (listed in {path})")
    recorded = field("fingerprint", str)
    actual = fingerprint_files(directory, files)
    if actual != recorded:
        raise TokenizerError(
            f"{directory / files[0]}: sha256 is {actual}, but {path} records fingerprint {recorded}; the file "
            f"changed after training (restore it, or retrain the tokenizer)"
        )
    return directory, path, description, field, files, actual


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer directory, checking ``tokenizer.json`` against the files it describes.

    Raises `TokenizerError` naming the file for a missing or damaged ``tokenizer.json`` or tokenizer file, a
    fingerprint that no longer matches the files, or special ids that disagree with the vocabulary.
    """
    directory, path, description, field, files, actual = _checked_description(directory)
    kind = description["kind"]
    vocab_size = field("vocab_size", int)
    eos_id, eod_id = field("eos_id", int), field("eod_id", int)
    unk_id = field("unk_id", (int, type(None)))
    tokenizer = _CLASSES[kind](directory, files, actual, vocab_size, eos_id, eod_id, unk_id)
    if tokenizer._entries != vocab_size:
        raise TokenizerError(
            f"{path}: key 'vocab_size' is {vocab_size}, but {directory / files[0]} has {tokenizer._entries} entries"
        )
    pieces = field("pieces", dict)
    for name, token_id in (("eos", eos_id), ("eod", eod_id), ("unk", unk_id)):
        if token_id is None:
            continue
        if not 0 <= token_id < vocab_size:
            raise TokenizerError(f"{path}: key '{name}_id' is {token_id}, outside [0, {vocab_size})")
        if pieces.get(name) != tokenizer.id_to_piece(token_id):
            raise TokenizerError(
                f"{path}: '{name}_id' {token_id} is {tokenizer.id_to_piece(token_id)!r} in {directory / files[0]}, "
                f"but key 'pieces.{name}' says {pieces.get(name)!r}"
            )
    return tokenizer


def find_tokenizer_dir(fingerprint: str, candidates: Iterable[str | os.PathLike | None], strict: bool = False) -> Path:
    """The first candidate directory holding a tokenizer with ``fingerprint``.

    ``None`` candidates are skipped. Without ``strict`` a candidate that is missing, damaged or of another
    fingerprint is passed over; with ``strict`` it is an error. When none fits, the error names every candidate
    and why it was passed over.
    """
    passed_over = []
    for candidate in candidates:
        if candidate is None:
            continue
        directory = Path(candidate)
        try:
            found = load_tokenizer(directory).fingerprint  # the whole check: a copy to keep or convert with
        except TokenizerError as error:
            if strict:
                raise
            passed_over.append(str(error))
            continue
        if found == fingerprint:
            return directory
        problem = f"{directory}: fingerprint {found}, not the wanted {fingerprint}"
        if strict:
            raise TokenizerError(problem)
        passed_over.append(problem)
    raise TokenizerError(
        f"no tokenizer with fingerprint {fingerprint} among the candidates "
        f"({'; '.join(passed_over) or 'none given'}); pass its directory"
    )
