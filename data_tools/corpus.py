"""Reading raw corpora for the tokenizer trainer and the shard builder.

Inputs are plain text files, gzip-compressed ones (``.gz``) and JSON Lines (``.jsonl``, ``.jsonl.gz``: one JSON
object per line, the document's text in one of its fields). A document is a whole file, a line (PTB, One Billion
Word sentences) or a paragraph: lines between blank lines (``--doc-per file|line|blank-line``). A JSON record is
always one document.

Reading comes in two halves so that a parent process can stay light while workers do the work:

- `read_chunks` (parent) cuts the input bytes into chunks of whole documents, looking only for line ends (and
  blank lines); chunks depend on the input and ``chunk_bytes`` alone, and each records where it starts, so that
  a build can restart at any chunk.
- `chunk_documents` (worker) decodes a chunk into documents, each a list of lines.

The authors' benchmarks have importers of their own (``--format enwik8|text8|wikitext``): `enwik8_splits`,
`text8_splits` (byte ranges of the one file, or of the file inside its zip, found and CRC-checked by
`data_tools.zip_member`) and `wikitext_splits`. Byte and char tokenizers cut chunks into documents with
`data_tools.character_documents`, which keeps every byte.

Lines end at ``\\n`` only (``\\r\\n`` is read as ``\\n``): Python's ``str.splitlines`` would also break at
U+2028, U+0085 and the like, which occur inside One Billion Word sentences.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from data_tools import zip_member

DOC_UNITS = ("line", "blank-line", "file")
DEFAULT_CHUNK_BYTES = 1 << 20
FORMATS = ("text", "lm1b", "ptb", "enwik8", "text8", "wikitext")
CHARACTER_FORMATS = ("enwik8", "text8")

# The authors' character benchmarks (their prep_enwik8.py and prep_text8.py): the last 10M bytes held out, valid
# the first 5M of them, test the last 5M.
CHARACTER_CORPUS_BYTES = 100_000_000
HELD_OUT_BYTES = 5_000_000
WIKITEXT_FILES = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens", "test": "wiki.test.tokens"}
WIKITEXT_RENAMED = {"train": "train.txt", "valid": "valid.txt", "test": "test.txt"}  # the authors' getdata.sh

LM1B_TRAIN_DIR = "training-monolingual.tokenized.shuffled"
LM1B_HELDOUT_DIR = "heldout-monolingual.tokenized.shuffled"
LM1B_TRAIN_FILES = tuple(f"news.en-{i:05d}-of-00100" for i in range(1, 100))
LM1B_TEST_FILE = "news.en.heldout-00000-of-00050"
LM1B_DEFAULT_VALID_FILE = "news.en.heldout-00001-of-00050"

PTB_FILES = {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}
TREEBANK_PREFIX = "treebank:penn/"


class InputError(ValueError):
    """Input that cannot be read as asked; the message names the file (and the byte offset or line)."""


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input: a path, or ``treebank:penn/{split}`` for the Penn Treebank of the ``treebank`` package."""

    name: str
    size: int
    """Bytes on disk (compressed bytes for ``.gz``); for a byte range, the range's length."""
    start: int = 0
    """First byte of the range read (enwik8/text8 splits); offsets of chunks stay offsets in the whole file."""
    stop: int | None = None
    """End of the range read (exclusive); None: the end of the file."""
    member: str | None = None
    """The file inside a ``.zip`` archive (enwik8.zip holds ``enwik8``); offsets count its decompressed bytes."""

    @property
    def jsonl(self) -> bool:
        return self.name.endswith((".jsonl", ".jsonl.gz"))

    @property
    def compressed(self) -> bool:
        """Chunks of this input travel to workers with their bytes (they cannot be re-read by offset cheaply)."""
        return self.name.endswith(".gz") or self.member is not None

    def open(self) -> BinaryIO:
        if self.name.startswith(TREEBANK_PREFIX):
            return io.BytesIO(_treebank_text(self.name.removeprefix(TREEBANK_PREFIX)))
        try:
            if self.member is not None:
                handle = zip_member.open_member(self.name, self.member)
            else:
                handle = gzip.open(self.name, "rb") if self.name.endswith(".gz") else open(self.name, "rb")
        except OSError as error:
            raise InputError(f"{self.name}: cannot open input ({error.strerror})") from error
        if self.start or self.stop is not None:
            return _ByteRange(handle, self.start, self.stop)
        return handle

    def describe(self) -> dict[str, object]:
        """What identifies this input in a build record (``--resume`` checks it, and the sha256 of the bytes read:
        `data_tools.input_digests`)."""
        described: dict[str, object] = {"name": self.name, "size": self.size}
        if self.start or self.stop is not None:
            described.update(start=self.start, stop=self.stop)
        if self.member is not None:
            described["member"] = self.member
        return described


class _ByteRange(io.RawIOBase):
    """Bytes [start, stop) of a file, read, read line by line and sought in the file's own offsets."""

    def __init__(self, handle: BinaryIO, start: int, stop: int | None):
        super().__init__()
        self._handle, self._start, self._stop = handle, start, stop
        handle.seek(start)
        self._position = start

    def _room(self, size: int) -> int:
        left = None if self._stop is None else max(0, self._stop - self._position)
        if size is None or size < 0:
            return -1 if left is None else left
        return size if left is None else min(size, left)

    def read(self, size: int = -1) -> bytes:
        room = self._room(size)
        data = self._handle.read(room) if room != 0 else b""
        self._position += len(data)
        return data

    def readline(self, size: int = -1) -> bytes:
        room = self._room(size)
        data = self._handle.readline(room) if room != 0 else b""
        self._position += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a byte range seeks to absolute offsets only")
        self._position = self._handle.seek(max(offset, self._start))
        return self._position

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._handle.close()
        super().close()


def _treebank_text(split: str) -> bytes:
    import treebank

    return treebank.penn[split].encode("utf-8")


def input_files(patterns: Sequence[str]) -> list[InputFile]:
    """The files named by paths and glob patterns, each pattern's matches sorted (absolute paths)."""
    files: list[InputFile] = []
    for pattern in patterns:
        if any(char in pattern for char in "*?["):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise InputError(f"{pattern}: no input file matches this pattern")
        else:
            matches = [pattern]
        for match in matches:
            path = Path(match)
            if not path.exists():
                raise InputError(f"{match}: no such input file")
            if path.is_dir():
                raise InputError(f"{match}: is a directory; give files, or a pattern such as '{match}/*.txt'")
            if zip_member.is_zip(zip_member.file_magic(path)):
                raise InputError(
                    f"{match}: is a zip archive, which is not read as text; unzip it (enwik8.zip and text8.zip: "
                    f"--format enwik8|text8 --input {match})"
                )
            files.append(InputFile(os.path.abspath(match), path.stat().st_size))
    names = [f.name for f in files]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InputError(f"{repeated[0]}: given more than once (its documents would be read twice)")
    return files


def lm1b_splits(directory: str | os.PathLike, valid_file: str = LM1B_DEFAULT_VALID_FILE) -> dict[str, list[InputFile]]:
    """train/valid/test of the ``1-billion-word-language-modeling-benchmark-r13output`` layout.

    The authors' scripts used ``heldout-00000`` for both valid and test, which selects models on the test set;
    here valid is another heldout file and may not be the test file.
    """
    directory = Path(directory)
    if valid_file == LM1B_TEST_FILE:
        raise InputError(
            f"--lm1b-valid {valid_file}: that is the test file; validating on it selects models on the test set "
            f"(the mistake of the original scripts). Choose another heldout file, e.g. {LM1B_DEFAULT_VALID_FILE}"
        )
    train = [directory / LM1B_TRAIN_DIR / name for name in LM1B_TRAIN_FILES]
    layout = {
        "train": train,
        "valid": [directory / LM1B_HELDOUT_DIR / valid_file],
        "test": [directory / LM1B_HELDOUT_DIR / LM1B_TEST_FILE],
    }
    for paths in layout.values():
        for path in paths:
            if not path.is_file():
                raise InputError(f"{path}: missing; expected the One Billion Word layout under {directory}")
    return {split: input_files([str(path) for path in paths]) for split, paths in layout.items()}


def ptb_splits(directory: str | os.PathLike | None = None) -> dict[str, list[InputFile]]:
    """train/valid/test of the Penn Treebank: ``ptb.{train,valid,test}.txt`` in ``directory``, or, without a
    directory, the copy in the ``treebank`` package."""
    if directory is None:
        return {split: [InputFile(TREEBANK_PREFIX + split, len(_treebank_text(split)))] for split in PTB_FILES}
    splits = {}
    for split, name in PTB_FILES.items():
        path = Path(directory) / name
        if not path.is_file():
            raise InputError(f"{path}: missing; expected Mikolov's Penn Treebank files {list(PTB_FILES.values())}")
        splits[split] = input_files([str(path)])
    return splits


def held_out_tail_ranges(total: int, held_out: int = HELD_OUT_BYTES) -> dict[str, tuple[int, int]]:
    """The authors' split of a character corpus of ``total`` bytes (prep_enwik8.py, prep_text8.py): train =
    ``data[:-2h]``, valid = ``data[-2h:-h]``, test = ``data[-h:]`` with h = ``held_out`` (5,000,000), as
    [start, stop) byte offsets. For the 100,000,000 bytes of enwik8 and text8: 0-90M, 90M-95M, 95M-100M."""
    if held_out < 1:
        raise InputError(f"--held-out-bytes {held_out}: must be positive")
    if total <= 2 * held_out:
        raise InputError(
            f"a corpus of {total:,} bytes has nothing left for train after 2 x {held_out:,} held-out "
            f"bytes (the authors' split needs more than {2 * held_out:,}; see --held-out-bytes)"
        )
    return {
        "train": (0, total - 2 * held_out),
        "valid": (total - 2 * held_out, total - held_out),
        "test": (total - held_out, total),
    }


def enwik8_splits(path: str | os.PathLike, held_out: int = HELD_OUT_BYTES) -> dict[str, list[InputFile]]:
    """train/valid/test of enwik8 (the file, ``enwik8.zip``, or a directory with either): the byte ranges of
    `held_out_tail_ranges`, every byte kept (the authors' data goes through text files of byte values)."""
    name, member, total = zip_member.character_corpus(path, "enwik8")
    return {
        split: [InputFile(name, stop - start, start, stop, member)]
        for split, (start, stop) in held_out_tail_ranges(total, held_out).items()
    }


# What str.strip() removes among ASCII bytes (text8 is ASCII: its character offsets are byte offsets).
_ASCII_WHITESPACE = frozenset(code for code in range(128) if chr(code).isspace())


def text8_splits(path: str | os.PathLike, held_out: int = HELD_OUT_BYTES) -> dict[str, list[InputFile]]:
    """train/valid/test of text8 (the file, ``text8.zip``, or a directory with either): the ranges of
    `held_out_tail_ranges`, each without the whitespace at its two ends, as the authors' prep_text8.py strips
    each part (text8 begins with a space, and the cuts fall between words or inside them)."""
    name, member, total = zip_member.character_corpus(path, "text8")
    splits = {}
    for split, (start, stop) in held_out_tail_ranges(total, held_out).items():
        start, stop = _strip_range(InputFile(name, stop - start, start, stop, member))
        splits[split] = [InputFile(name, stop - start, start, stop, member)]
    return splits


def _strip_range(input_file: InputFile, window: int = 4096) -> tuple[int, int]:
    """[start, stop) of the input's range without leading and trailing ASCII whitespace."""
    start, stop = input_file.start, input_file.stop
    with input_file.open() as handle:
        while start < stop:
            handle.seek(start)
            data = handle.read(min(window, stop - start))
            kept = next((i for i, byte in enumerate(data) if byte not in _ASCII_WHITESPACE), None)
            if kept is not None:
                start += kept
                break
            start += len(data)
        while stop > start:
            handle.seek(max(start, stop - window))
            data = handle.read(stop - max(start, stop - window))
            kept = next((i for i in range(len(data) - 1, -1, -1) if data[i] not in _ASCII_WHITESPACE), None)
            if kept is not None:
                stop -= len(data) - 1 - kept
                break
            stop -= len(data)
    if start >= stop:
        raise InputError(f"{input_file.name}: bytes {input_file.start}-{input_file.stop} hold only whitespace")
    return start, stop


def wikitext_splits(directory: str | os.PathLike) -> dict[str, list[InputFile]]:
    """train/valid/test of WikiText-103 or WikiText-2: ``wiki.{train,valid,test}.tokens`` in ``directory`` (the
    unzipped download), or the authors' renamed ``train.txt``, ``valid.txt``, ``test.txt``."""
    directory = Path(directory)
    for names in (WIKITEXT_FILES, WIKITEXT_RENAMED):
        paths = {split: directory / name for split, name in names.items()}
        if all(p.is_file() for p in paths.values()):
            return {split: input_files([str(p)]) for split, p in paths.items()}
    raise InputError(
        f"{directory}: expected {', '.join(WIKITEXT_FILES.values())} (or the authors' renamed "
        f"{', '.join(WIKITEXT_RENAMED.values())}); unzip wikitext-103-v1.zip and pass its folder"
    )


@dataclasses.dataclass(frozen=True)
class ReadPosition:
    """Where chunk number ``chunk`` begins: byte ``offset`` (line ``line``, from 1) of input file ``file``
    (offsets count decompressed bytes for ``.gz``)."""

    chunk: int = 0
    file: int = 0
    offset: int = 0
    line: int = 1


@dataclasses.dataclass
class Chunk:
    """Bytes of whole documents of one input file."""

    start: ReadPosition
    path: str
    jsonl: bool
    data: bytes | None
    """The bytes; None in a chunk made `portable` (its worker reads them with `resolve`)."""
    length: int = -1
    """Bytes of a portable chunk."""
    crc32: int = 0
    """CRC-32 of the bytes of a portable chunk, checked when they are read again."""


def portable(chunk: Chunk) -> Chunk:
    """The chunk as it travels to a worker process. A chunk of a plain file travels as where its bytes lie and their
    CRC-32, and the worker reads them again from the page cache, which costs far less than sending them through a
    pipe (most of that cost is a worker thread fighting the tokenising one for the GIL). Chunks of .gz files and of
    the treebank package travel with their bytes."""
    if chunk.data is None or chunk.path.endswith((".gz", ".zip")) or chunk.path.startswith(TREEBANK_PREFIX):
        return chunk
    return dataclasses.replace(chunk, data=None, length=len(chunk.data), crc32=zlib.crc32(chunk.data))


def resolve(chunk: Chunk) -> Chunk:
    """A chunk with its bytes: a `portable` one read again and checked."""
    if chunk.data is not None:
        return chunk
    where = f"{chunk.path}, bytes {chunk.start.offset}-{chunk.start.offset + chunk.length}"
    try:
        with open(chunk.path, "rb") as handle:
            handle.seek(chunk.start.offset)
            data = handle.read(chunk.length)
    except OSError as error:
        raise InputError(f"{where}: cannot read input again ({error.strerror})") from error
    if len(data) != chunk.length or zlib.crc32(data) != chunk.crc32:
        raise InputError(f"{where}: the file changed while it was being read; rerun on a file that stays as is")
    return dataclasses.replace(chunk, data=data)


def read_chunks(
    files: Sequence[InputFile], doc_unit: str, chunk_bytes: int, start: ReadPosition = ReadPosition()
) -> Iterator[Chunk]:
    """Chunks of about ``chunk_bytes`` (a whole file per chunk for ``doc_unit == "file"``), from ``start`` on.

    A chunk ends at a line end, and for paragraphs after a blank line, so no document spans two chunks (a
    paragraph longer than ``chunk_bytes`` makes a longer chunk). Files are read in order, one chunk never holds
    two files.
    """
    if doc_unit not in DOC_UNITS:
        raise ValueError(f"doc_unit must be one of {DOC_UNITS}, got {doc_unit!r}")
    chunk_index = start.chunk
    for file_index in range(start.file, len(files)):
        input_file = files[file_index]
        offset, line = (start.offset, start.line) if file_index == start.file else (0, 1)
        offset = max(offset, input_file.start)  # a byte range's chunks count offsets in the whole file
        unit = "line" if input_file.jsonl else doc_unit
        with input_file.open() as handle:
            try:
                if offset:
                    handle.seek(offset)
                while True:
                    data = _read_chunk(handle, unit, chunk_bytes)
                    if not data and (unit != "file" or offset):
                        break
                    yield Chunk(
                        ReadPosition(chunk_index, file_index, offset, line), input_file.name, input_file.jsonl, data
                    )
                    chunk_index += 1
                    offset += len(data)
                    line += data.count(b"\n")
                    if unit == "file":
                        break
            except (OSError, EOFError, zlib.error) as error:
                raise InputError(f"{input_file.name}: cannot read past byte {offset} ({error})") from error


def _read_chunk(handle: BinaryIO, unit: str, chunk_bytes: int) -> bytes:
    if unit == "file":
        return handle.read()
    data = handle.read(chunk_bytes)
    if data and not data.endswith(b"\n"):
        data += handle.readline()
    if unit == "blank-line" and data:
        # End after a blank line so that no paragraph spans two chunks ("blank": only ASCII whitespace, which
        # `chunk_documents` also sees as blank).
        last_line = data[data.rfind(b"\n", 0, len(data) - 1) + 1 :]
        parts = [data]
        while last_line.strip():
            last_line = handle.readline()
            if not last_line:
                break
            parts.append(last_line)
        data = b"".join(parts)
    return data


@dataclasses.dataclass
class ChunkText:
    """The documents of a chunk, with the counts of their raw text."""

    documents: list[list[str]]
    """The non-empty documents, each a list of lines (without their ``\n``)."""
    indices: np.ndarray
    """Each document's position among all documents of the chunk, empty ones included."""
    words: np.ndarray
    """Whitespace-separated words (``str.split()``) of each document."""
    characters: np.ndarray
    """Characters of each document, the ``\n`` between its lines included."""
    empty: int
    """Documents skipped because they hold nothing but whitespace."""
    replaced_bytes: int
    """Bytes that were not UTF-8 and became U+FFFD."""


# Whether each code point is whitespace for str.split(); none above U+3000 is.
_WHITESPACE = np.array([chr(code).isspace() for code in range(0x3001)] + [False])


def words_per_line(text: str) -> np.ndarray:
    """``[len(line.split()) for line in text.split("\n")]`` (without the empty piece after a final ``\n``),
    computed with numpy: the per-line Python loop costs as much as a sixth of SentencePiece's encoding."""
    if text.isascii():
        codes = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
        space = _WHITESPACE[:256][codes]
    else:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        space = _WHITESPACE[np.minimum(codes, len(_WHITESPACE) - 1)]
    word_starts = ~space
    word_starts[1:] &= space[:-1]
    line_ends = np.flatnonzero(codes == ord("\n"))
    if not text.endswith("\n"):
        line_ends = np.append(line_ends, len(codes))
    return np.diff(np.searchsorted(np.flatnonzero(word_starts), line_ends), prepend=0)


def chunk_documents(chunk: Chunk, doc_unit: str, jsonl_field: str, strict: bool, keep_blank: bool = False) -> ChunkText:
    """Decode a chunk and cut it into documents (see the module docstring). ``keep_blank`` keeps the lines of
    nothing but whitespace as (empty) documents with one document per line: WikiText, whose every line, blank or
    not, ends with ``<eos>`` in the authors' data."""
    text, replaced_bytes = _decode(chunk, strict)
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    if not chunk.jsonl and doc_unit == "line":  # the path of the large corpora: vectorised counts
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        words = words_per_line(text)
        characters = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
        if words.all() or keep_blank:
            return ChunkText([[line] for line in lines], np.arange(len(lines)), words, characters, 0, replaced_bytes)
        indices = np.flatnonzero(words)  # a line without words holds only whitespace
        return ChunkText(
            [[lines[i]] for i in indices.tolist()],
            indices,
            words[indices],
            characters[indices],
            len(lines) - len(indices),
            replaced_bytes,
        )
    if chunk.jsonl:
        candidates = _jsonl_documents(text, chunk, jsonl_field)
    elif doc_unit == "file":
        candidates = [text.split("\n")]
    else:
        candidates = _paragraphs(text)
    documents, indices = [], []
    for index, lines in enumerate(candidates):
        lines = _trim_blank_lines(lines)
        if lines:
            documents.append(lines)
            indices.append(index)
    words = [sum(len(line.split()) for line in document) for document in documents]
    characters = [sum(map(len, document)) + len(document) - 1 for document in documents]
    return ChunkText(
        documents,
        np.array(indices, dtype=np.int64),
        np.array(words, dtype=np.int64),
        np.array(characters, dtype=np.int64),
        len(candidates) - len(documents),
        replaced_bytes,
    )


def invalid_utf8(chunk: Chunk, error: UnicodeDecodeError, advice: str) -> InputError:
    """The error for the first byte of ``chunk`` that is not UTF-8: the file, the byte offset (in the decompressed
    text of a .gz) and the line, then ``advice`` (which starts with its own separator)."""
    offset = chunk.start.offset + error.start
    line = chunk.start.line + chunk.data.count(b"\n", 0, error.start)
    where = " of the decompressed text" if chunk.path.endswith(".gz") else ""
    return InputError(f"{chunk.path}: invalid UTF-8 at byte offset {offset}{where} (line {line}){advice}")


def _decode(chunk: Chunk, strict: bool) -> tuple[str, int]:
    try:
        return chunk.data.decode("utf-8"), 0
    except UnicodeDecodeError as error:
        if strict:
            raise invalid_utf8(
                chunk, error, "; fix the file, or drop --strict to replace such bytes with U+FFFD"
            ) from error
    # The bytes that 'ignore' drops are exactly the invalid ones (valid UTF-8 re-encodes to itself).
    replaced = len(chunk.data) - len(chunk.data.decode("utf-8", "ignore").encode("utf-8"))
    return chunk.data.decode("utf-8", "replace"), replaced


def _jsonl_documents(text: str, chunk: Chunk, field: str) -> list[list[str]]:
    return [value.replace("\r\n", "\n").split("\n") for _, value in jsonl_records(text, chunk, field)]


def jsonl_records(text: str, chunk: Chunk, field: str) -> Iterator[tuple[int, str]]:
    """(line number, text field) of each record of a .jsonl chunk's text; blank lines are no records."""
    for number, line in enumerate(text.split("\n"), start=chunk.start.line):
        if not line.strip():
            continue
        where = f"{chunk.path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error
        if not isinstance(record, dict) or field not in record:
            raise InputError(f"{where}: expected a JSON object with the field '{field}' (set it with --jsonl-field)")
        value = record[field]
        if not isinstance(value, str):
            raise InputError(f"{where}: field '{field}' is {type(value).__name__}, expected a string")
        yield number, value


def _paragraphs(text: str) -> list[list[str]]:
    paragraphs, current = [], []
    for line in text.split("\n"):
        if line.strip():
            current.append(line)
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    return paragraphs


def _trim_blank_lines(lines: list[str]) -> list[str]:
    """The lines without leading and trailing blank ones (inner blank lines stay: they separate paragraphs)."""
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        return []
    last = max(i for i, line in enumerate(lines) if line.strip())
    return lines[first : last + 1]
