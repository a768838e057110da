"""The parent's half of reading the inputs: `read_chunks` cuts their bytes into `Chunk`s of whole documents (a
document is a whole file, a line or a paragraph: ``DOC_UNITS``, ``--doc-per``), looking only for line ends and blank
lines, so that the parent process stays light while workers decode the chunks (`data_tools.corpora.text_decoding`).
Chunks depend on the input and ``chunk_bytes`` alone, and each records where it starts (`ReadPosition`), so that a
build can restart at any chunk; `portable` and `resolve` send a chunk of a plain file to a worker as where its bytes
lie, and read them again there."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from data_tools.corpora.inputs import TREEBANK_PREFIX, InputFile
from data_tools.errors import InputError

DOC_UNITS = ("line", "blank-line", "file")
DEFAULT_CHUNK_BYTES = 1 << 20


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
