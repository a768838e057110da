"""The workers' half of reading the inputs: `chunk_documents` decodes a `Chunk` of `data_tools.corpora.chunking` as
UTF-8 (a byte that is not is refused, `invalid_utf8`, or replaced) and cuts it into documents, each a list of lines:
a whole file, a line (PTB, One Billion Word sentences) or a paragraph, the lines between blank lines (``--doc-per
file|line|blank-line``); a JSON record (`jsonl_records`) is always one document. Lines end at ``\\n`` only
(``\\r\\n`` is read as ``\\n``): Python's ``str.splitlines`` would also break at U+2028, U+0085 and the like, which
occur inside One Billion Word sentences. Byte and char tokenizers cut chunks with
`data_tools.corpora.character_documents` instead, which keeps every byte."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import numpy as np

from data_tools.corpora.chunking import Chunk
from data_tools.errors import InputError


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
