"""Tokenising one chunk of documents into the token arrays of the splits it feeds: the work a spawned worker does.

Workers are spawned and import this module: keep its imports light (no torch, no webdataset).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from data_tools.corpora import character_documents, chunking, text_decoding
from data_tools.shards.settings import Holdout
from txl_dist.data.format import token_dtype
from txl_dist.tokenizer import CharTokenizer, Tokenizer, WordTokenizer, load_tokenizer
from txl_dist.tokenizer.characters import UnknownCharacterError
from txl_dist.tokenizer.rules import DEFAULT_RULES
from txl_dist.word_scan import scan_lines


@dataclasses.dataclass
class StreamPiece:
    """The documents of one chunk that go to one split."""

    tokens: np.ndarray
    """The documents' tokens, separators included, in the shards' dtype."""
    document_tokens: np.ndarray
    document_words: np.ndarray
    document_characters: np.ndarray
    document_indices: np.ndarray
    """Each document's index within its chunk (see `text_decoding.ChunkText.indices`)."""


@dataclasses.dataclass
class ChunkResult:
    chunk: int
    bytes: int
    documents: int
    empty_documents: int
    replaced_bytes: int
    pieces: dict[str, StreamPiece]


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs of the build's settings to tokenise a chunk (sent to each spawned worker once)."""

    tokenizer_directory: str
    doc_unit: str
    jsonl_field: str
    strict: bool
    holdout: Holdout | None
    input_format: str = "text"


_worker: tuple[WorkerSettings, Tokenizer, np.dtype] | None = None


def start_worker(settings: WorkerSettings, tokenizer: Tokenizer | None = None) -> None:
    """Load the tokenizer of a worker process (or, in this process, adopt the builder's)."""
    global _worker
    tokenizer = tokenizer or load_tokenizer(settings.tokenizer_directory)
    _worker = (settings, tokenizer, token_dtype(tokenizer.vocab_size))


Task = tuple[chunking.Chunk, tuple[tuple[str, int | None], ...]]
"""A chunk and, per split it feeds, the index of its first document still to tokenise (None: the split already
holds all of them)."""


def tokenize_chunk(task: Task) -> ChunkResult:
    """Documents of a chunk -> token arrays per split (see `Task`)."""
    chunk, streams = task
    chunk = chunking.resolve(chunk)
    settings, tokenizer, dtype = _worker
    if (
        isinstance(tokenizer, WordTokenizer)
        and tokenizer.fast_lines
        and settings.doc_unit == "line"
        and not chunk.jsonl
        and len(streams) == 1
        and streams[0][1] == 0
        and settings.input_format != "wikitext"
    ):
        result = _tokenize_lines(chunk, streams[0][0], tokenizer, dtype)
        if result is not None:
            return result
    if tokenizer.character_level:
        if (
            settings.doc_unit == "line"
            and not chunk.jsonl
            and len(streams) == 1
            and streams[0][1] is not None
            and tokenizer.rules == DEFAULT_RULES
        ):
            return _tokenize_characters(chunk, streams[0][0], streams[0][1], tokenizer, dtype)
        # --holdout, --doc-per file|blank-line, .jsonl: documents of their own, every byte (character) kept.
        alphabet = tokenizer if isinstance(tokenizer, CharTokenizer) else None
        text = character_documents.chunk_documents(
            chunk, settings.doc_unit, settings.jsonl_field, tokenizer.kind, alphabet
        )
    else:
        text = text_decoding.chunk_documents(
            chunk,
            settings.doc_unit,
            settings.jsonl_field,
            settings.strict,
            keep_blank=settings.input_format == "wikitext",
        )
    if len(streams) == 1:
        routes = {streams[0][0]: np.arange(len(text.documents))}
    else:
        (source, _), (holdout, _) = streams
        held_out = np.fromiter(map(settings.holdout.takes, text.documents), dtype=bool, count=len(text.documents))
        routes = {source: np.flatnonzero(~held_out), holdout: np.flatnonzero(held_out)}
    pieces = {}
    for split, first_document in streams:
        if first_document is None:
            continue
        selected = routes[split]
        if first_document:
            selected = selected[text.indices[selected] >= first_document]
        pieces[split] = _encode_piece(tokenizer, text, selected, dtype)
    return ChunkResult(chunk.start.chunk, len(chunk.data), len(text.documents), text.empty, text.replaced_bytes, pieces)


def _tokenize_lines(chunk: chunking.Chunk, split: str, tokenizer: WordTokenizer, dtype: np.dtype) -> ChunkResult | None:
    """The word tokenizer's fast path for one-document-per-line text (One Billion Word, PTB): the words are
    found and looked up with numpy (`txl_dist.word_scan`), faster than ``str.split`` and a dict lookup per word.
    None for text it does not take (see `txl_dist.word_scan.scan_lines`)."""
    scan = scan_lines(chunk.data)
    if scan is None:
        return None
    tokens, document_tokens = tokenizer.encode_scanned_lines(scan, dtype)
    documents = np.flatnonzero(scan.words_per_line)
    piece = StreamPiece(
        tokens,
        document_tokens,
        scan.words_per_line[documents] + 1,
        scan.characters_per_line()[documents] + 1,
        documents,
    )
    return ChunkResult(
        chunk.start.chunk, len(chunk.data), len(documents), len(scan.words_per_line) - len(documents), 0, {split: piece}
    )


# Which bytes are whitespace for str.split() (ASCII only: a byte of 128 or more is part of a character).
_BYTE_IS_SPACE = np.array([code < 128 and chr(code).isspace() for code in range(256)])


def _tokenize_characters(
    chunk: chunking.Chunk, split: str, first_document: int, tokenizer: Tokenizer, dtype: np.dtype
) -> ChunkResult:
    """The byte and character tokenizers' path: every line a document, blank lines included, nothing replaced
    or dropped, so the chunk's tokens are its bytes (characters) with a newline closing an unended last line.
    Documents before ``first_document`` (a resume inside the chunk) are left out."""
    data = chunk.data
    if tokenizer.kind == "byte":
        ids = np.frombuffer(data, dtype=np.uint8)
        is_space = _BYTE_IS_SPACE[ids]
    else:
        text = character_documents.decode(chunk, "char")  # a character alphabet has no stand-in for bad bytes
        try:
            ids = tokenizer.encode_text(text)
        except UnknownCharacterError as error:
            alphabet = str(tokenizer.directory / tokenizer.files[0])
            raise character_documents.unknown_character(chunk, text, error, alphabet) from None
        is_space = tokenizer.is_space[ids]
    newline = tokenizer.eos_id
    if len(ids) and ids[-1] != newline:
        ids = np.append(ids, np.asarray([newline], dtype=ids.dtype))
        is_space = np.append(is_space, True)
    ends = np.flatnonzero(ids == newline) + 1
    document_tokens = np.diff(ends, prepend=0)
    word_starts = ~is_space
    word_starts[1:] &= is_space[:-1]
    words = np.diff(np.searchsorted(np.flatnonzero(word_starts), ends), prepend=0)
    first = min(first_document, len(ends))
    begin = int(ends[first - 1]) if first else 0
    piece = StreamPiece(
        ids[begin:].astype(dtype),
        document_tokens[first:],
        words[first:] + 1,
        document_tokens[first:].copy(),
        np.arange(first, len(ends)),
    )
    return ChunkResult(chunk.start.chunk, len(data), len(ends), 0, 0, {split: piece})


def _encode_piece(
    tokenizer: Tokenizer, text: text_decoding.ChunkText, selected: np.ndarray, dtype: np.dtype
) -> StreamPiece:
    """The documents ``text.documents[selected]`` as a piece of a split's stream."""
    if len(selected) == len(text.documents):
        documents = text.documents
    else:
        documents = [text.documents[i] for i in selected.tolist()]
    tokens, document_tokens = tokenizer.encode_documents(documents, dtype=dtype)
    # Words and characters of the raw text plus one per document (its separator); see ShardEntry.
    return StreamPiece(
        tokens, document_tokens, text.words[selected] + 1, text.characters[selected] + 1, text.indices[selected]
    )
