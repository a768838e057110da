"""The documents of a chunk as a byte or character tokenizer reads them: every byte (character) kept.

The text path of word and SentencePiece tokenizers (`text_decoding.chunk_documents`) skips blank documents, reads
``\\r\\n`` as ``\\n`` and replaces bytes that are not UTF-8 with U+FFFD. None of that happens here, on any path a
byte or char tokenizer takes (``--holdout``, ``--doc-per``, ``.jsonl``):

- ``line``: every line is a document, blank ones included.
- ``file``: the whole file is one document.
- ``blank-line``: a document is a paragraph and the blank lines after it (those before a chunk's first paragraph
  join it), so the documents, one after another, are the text itself.
- ``.jsonl``: a document is a record's text field as JSON decodes it, ``\\r`` and blank lines included; a record
  whose field is empty has no characters and is counted as an empty document.

A document's lines each end with the newline, so a split's tokens are its documents' text with one newline more
where a document (a file, a record) does not end with one. A byte tokenizer reads bytes that are not UTF-8 as
lone surrogates (``surrogateescape``), which it encodes back to the same bytes. A char tokenizer has no token for
them: invalid UTF-8, and a character outside its alphabet, are errors naming the file, the byte offset and the
line.
"""

from __future__ import annotations

import numpy as np

from data_tools.corpora import text_decoding
from data_tools.corpora.chunking import Chunk
from data_tools.corpora.text_decoding import ChunkText
from data_tools.errors import InputError
from txl_dist.tokenizer import CharTokenizer
from txl_dist.tokenizer.characters import UnknownCharacterError


def decode(chunk: Chunk, kind: str) -> str:
    """The chunk's text for a tokenizer of ``kind`` (byte: invalid bytes as lone surrogates; char: UTF-8 only)."""
    if kind == "byte":
        return chunk.data.decode("utf-8", "surrogateescape")
    try:
        return chunk.data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise text_decoding.invalid_utf8(
            chunk,
            error,
            ": a char tokenizer reads UTF-8 text only; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8), "
            "or use a byte tokenizer",
        ) from error


def unknown_character(chunk: Chunk, text: str, error: UnknownCharacterError, alphabet: str) -> InputError:
    """The error for a character of ``text`` (the chunk's decoded text) outside ``alphabet`` (the file or flag that
    holds it), naming the input, the byte offset and the line."""
    offset = chunk.start.offset + len(text[: error.index].encode("utf-8", "surrogatepass"))
    line = chunk.start.line + text.count("\n", 0, error.index)
    return InputError(
        f"{chunk.path}: character {error.character!r} (U+{ord(error.character):04X}) at byte offset {offset} "
        f"(line {line}) is not in the alphabet of {alphabet}; train the char tokenizer on this text, or give it "
        f"an --alphabet that holds this character"
    )


def chunk_documents(
    chunk: Chunk, doc_unit: str, jsonl_field: str, kind: str, alphabet: CharTokenizer | None = None
) -> ChunkText:
    """The documents of a chunk for a tokenizer of ``kind`` (byte or char; see the module docstring). With the
    char tokenizer ``alphabet`` every character is checked here, so that an error can say where it is."""
    text = decode(chunk, kind)
    if chunk.jsonl:
        documents, empty = _jsonl_documents(chunk, text, jsonl_field, kind, alphabet)
    else:
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        if alphabet is not None:
            _check_alphabet(chunk, text, alphabet)
        if doc_unit == "line":
            documents = [[line] for line in lines]
        elif doc_unit == "file":
            documents = [lines] if text else []
        else:
            documents = _paragraphs_with_their_blank_lines(lines)
        empty = int(doc_unit == "file" and not text)
    words = [sum(len(line.split()) for line in document) for document in documents]
    characters = [sum(map(len, document)) + len(document) - 1 for document in documents]
    return ChunkText(
        documents,
        np.arange(len(documents), dtype=np.int64),
        np.array(words, dtype=np.int64),
        np.array(characters, dtype=np.int64),
        empty,
        0,
    )


def _check_alphabet(chunk: Chunk, text: str, tokenizer: CharTokenizer) -> None:
    try:
        tokenizer.encode_text(text)
    except UnknownCharacterError as error:
        raise unknown_character(chunk, text, error, str(tokenizer.directory / tokenizer.files[0])) from None


def _jsonl_documents(
    chunk: Chunk, text: str, field: str, kind: str, alphabet: CharTokenizer | None
) -> tuple[list[list[str]], int]:
    documents, empty = [], 0
    for number, value in text_decoding.jsonl_records(text, chunk, field):
        where = f"{chunk.path}, line {number}, field '{field}'"
        if kind == "byte":
            try:
                value.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError as error:
                raise InputError(
                    f"{where}: {value[error.start]!r} (a lone surrogate, from a JSON escape) has no UTF-8 bytes; "
                    f"fix the record"
                ) from None
        elif alphabet is not None:
            try:
                alphabet.encode_text(value)
            except UnknownCharacterError as error:
                vocabulary = alphabet.directory / alphabet.files[0]
                raise InputError(
                    f"{where}: character {error.character!r} (U+{ord(error.character):04X}, character "
                    f"{error.index} of the field) is not in the alphabet of {vocabulary}; train the char tokenizer "
                    f"on this text, or give it an --alphabet that holds this character"
                ) from None
        if value:
            documents.append(value.split("\n"))
        else:
            empty += 1
    return documents, empty


def _paragraphs_with_their_blank_lines(lines: list[str]) -> list[list[str]]:
    documents: list[list[str]] = []
    current: list[str] = []
    previous_blank = False
    for line in lines:
        blank = not line.strip()
        if not blank and previous_blank and any(part.strip() for part in current):
            documents.append(current)
            current = []
        current.append(line)
        previous_blank = blank
    if current:
        documents.append(current)
    return documents
