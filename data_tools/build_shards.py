"""Tokenise a raw corpus into deterministic webdataset shards (format: `txl_dist.data.format`).

    # your own text: one document per line (also: --doc-per file | blank-line; .gz and .jsonl inputs)
    python -m data_tools.build_shards --tokenizer tok/ --output shards/ \\
        --split train='corpus/train-*.txt.gz' --split valid=corpus/valid.txt --workers 8

    # a validation split drawn from the training documents by a hash of each document
    python -m data_tools.build_shards --tokenizer tok/ --output shards/ --split train='docs/*.jsonl' \\
        --jsonl-field text --holdout valid=0.01

    # One Billion Word (the r13output directory) and the Penn Treebank (the `treebank` package, or --input DIR)
    python -m data_tools.build_shards --tokenizer tok_lm1b/ --output lm1b/ --format lm1b \\
        --input 1-billion-word-language-modeling-benchmark-r13output --workers 16
    python -m data_tools.build_shards --tokenizer tok_ptb/ --output ptb/ --format ptb

    # the paper's other benchmarks, from the files as downloaded (a byte / character / word tokenizer)
    python -m data_tools.build_shards --tokenizer tok_enwik8/ --output enwik8/ --format enwik8 --input enwik8.zip
    python -m data_tools.build_shards --tokenizer tok_text8/ --output text8/ --format text8 --input text8.zip
    python -m data_tools.build_shards --tokenizer tok_wt103/ --output wt103/ --format wikitext --input wikitext-103/

    # continue an interrupted build (each finished shard is checked by its sha256)
    python -m data_tools.build_shards ... --resume

Documents. A document's tokens are followed by the tokenizer's ``eod_id`` (lines inside a multi-line document
end with ``eos_id``; see `txl_dist.tokenizer`), so a one-sentence-per-line corpus becomes each sentence followed
by one separator. Documents of nothing but whitespace are skipped and counted; bytes that are not UTF-8 become
U+FFFD and are counted, or with ``--strict`` stop the build with the file and byte offset. ``--holdout NAME=F``
sends a training document to split NAME when its 64-bit BLAKE2b hash (of its lines joined by ``\n``, in UTF-8,
read little-endian) is below F * 2**64: the same document always lands in the same split.

How it works. The parent process reads chunks of whole documents (`data_tools.corpus.read_chunks`), ``--workers``
processes decode and tokenise them, the parent and ``--workers - 1`` spawned ones (the tokenizer is loaded once
per worker; `data_tools.workers.ordered_map`: results in input order, up to 16 unanswered chunks per spawned
worker, so that none runs dry while the parent writes; the parent takes a chunk when they are all busy), and
the parent packs the documents into blocks and blocks into shards. With ``--workers 1`` all of it runs in one
process, and so does a source of fewer than 32 chunks (32 MB with the default ``--chunk-bytes``). With a word
tokenizer, plain one-document-per-line text is tokenised with numpy (`txl_dist.word_scan`; the same tokens as the
str path, three times faster). Which documents share a block depends only on the documents' token counts: a document
that does not fit in what is left of the current block starts the next one, and a document longer than a block spans
as many blocks as it needs (the next documents join its last block). The shards are therefore byte-identical for any
``--workers``.

Character data. With a byte or character tokenizer (`txl_dist.tokenizer`: ``byte``, ``char``) and one
document per line, every line of the input is a document, blank ones included, and nothing is replaced or
dropped: a split's tokens are exactly its bytes (characters), newlines included, and one newline more when the
input ends inside a line (the authors' final ``<eos>``). ``--format enwik8|text8`` cut the one file (or the file
inside its zip) at the authors' byte offsets (`corpus.held_out_tail_ranges`: 90M / 5M / 5M of 100M; text8's
parts stripped of their end spaces as prep_text8.py does); ``--format wikitext`` reads ``wiki.*.tokens`` and
keeps every line as a document, so each line, blank or not, ends with one ``<eos>``, as in the authors' data.

Resume. After each finished shard the builder journals, in ``OUT/.build_state.json`` (written atomically), the
shards written so far and where in the input each split continues. ``--resume`` checks each journaled shard's
sha256, re-reads the input from the earliest place any split continues from (documents that a split already
holds are read again but not tokenised) and writes the remaining shards. ``manifest.json`` is written only when
every split is complete, and not at all when a split has no document (an empty input is an error unless
``--allow-empty``). A write failure (no space, read-only output) is one line naming the file; the partial shard is
removed and the finished ones stay for ``--resume``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data_tools import corpus
from data_tools.corpus import InputError, InputFile, ReadPosition
from data_tools.workers import WorkerError, ordered_map
from txl_dist.data.format import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    ShardEntry,
    SplitEntry,
    TokenizerIdentity,
    token_dtype,
    write_manifest,
)
from txl_dist.fileio import (
    OutputPathError,
    atomic_write_text,
    describe_os_error,
    refuse_output_over_inputs,
    sha256_file,
)
from txl_dist.tokenizer import Tokenizer, TokenizerError, WordTokenizer, load_tokenizer
from txl_dist.word_scan import scan_lines

STATE_NAME = ".build_state.json"
DEFAULT_TOKENS_PER_BLOCK = 1 << 16
DEFAULT_TOKENS_PER_SHARD = 1 << 24
SMALL_SOURCE_CHUNKS = 32  # a source of fewer chunks than this is tokenised without worker processes
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")
OUTPUT_FILE = re.compile(r"^([A-Za-z0-9_]+-\d{6}\.tar|\..+\.(partial|tmp))$")


class BuildError(ValueError):
    """A build that cannot go on as asked; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Holdout:
    """Documents of split ``source`` whose hash falls below ``fraction`` go to split ``split`` instead."""

    split: str
    fraction: float
    source: str = "train"

    def takes(self, document: list[str]) -> bool:
        digest = hashlib.blake2b("\n".join(document).encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "little") < self.fraction * 2.0**64


@dataclasses.dataclass
class BuildSettings:
    """Everything that determines the shards (the worker count does not)."""

    tokenizer_directory: Path
    sources: dict[str, list[InputFile]]
    """Split name -> input files, in build order."""
    input_format: str = "text"
    doc_unit: str = "line"
    jsonl_field: str = "text"
    strict: bool = False
    holdout: Holdout | None = None
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD
    chunk_bytes: int = corpus.DEFAULT_CHUNK_BYTES
    """Bytes of text per unit of work; part of the settings because resume positions count chunks."""

    def __post_init__(self) -> None:
        for name in self.splits():
            if not SPLIT_NAME.match(name):
                raise BuildError(f"split name {name!r}: use letters, digits and '_' only")
        if not self.sources:
            raise BuildError("no split to build: give --split NAME=GLOB (or --format lm1b|ptb)")
        if self.doc_unit not in corpus.DOC_UNITS:
            raise BuildError(f"--doc-per {self.doc_unit!r}: expected one of {list(corpus.DOC_UNITS)}")
        for flag, value in (
            ("--tokens-per-block", self.tokens_per_block),
            ("--chunk-bytes", self.chunk_bytes),
            ("--tokens-per-shard", self.tokens_per_shard),
        ):
            if value <= 0:
                raise BuildError(f"{flag} {value}: must be positive")
        if self.tokens_per_shard < self.tokens_per_block:
            raise BuildError(
                f"--tokens-per-shard {self.tokens_per_shard} is smaller than --tokens-per-block {self.tokens_per_block}"
            )
        if self.holdout is not None:
            if not 0.0 < self.holdout.fraction < 1.0:
                raise BuildError(
                    f"--holdout {self.holdout.split}={self.holdout.fraction}: the fraction must lie in (0, 1)"
                )
            if self.holdout.source not in self.sources:
                raise BuildError(f"--holdout takes documents from split '{self.holdout.source}', which is not built")
            if self.holdout.split in self.sources:
                raise BuildError(
                    f"--holdout {self.holdout.split}=...: split '{self.holdout.split}' also has inputs; "
                    f"drop one of the two"
                )

    def streams_of(self, source: str) -> list[str]:
        """The splits fed by the documents of ``source``."""
        holdout = self.holdout
        return [source, holdout.split] if holdout is not None and holdout.source == source else [source]

    def splits(self) -> list[str]:
        return [split for source in self.sources for split in self.streams_of(source)]

    def record(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """The settings as JSON (for the manifest's ``build`` and the ``--resume`` check)."""
        return {
            "builder": "data_tools.build_shards",
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "format": self.input_format,
            "inputs": {split: [f.describe() for f in files] for split, files in self.sources.items()},
            "doc_per": self.doc_unit,
            "jsonl_field": self.jsonl_field,
            "strict": self.strict,
            "holdout": dataclasses.asdict(self.holdout) if self.holdout else None,
            "tokens_per_block": self.tokens_per_block,
            "tokens_per_shard": self.tokens_per_shard,
            "chunk_bytes": self.chunk_bytes,
        }


# ---- worker side: keep the imports of this module light, workers are spawned and import it -------------------


@dataclasses.dataclass
class StreamPiece:
    """The documents of one chunk that go to one split."""

    tokens: np.ndarray
    """The documents' tokens, separators included, in the shards' dtype."""
    document_tokens: np.ndarray
    document_words: np.ndarray
    document_characters: np.ndarray
    document_indices: np.ndarray
    """Each document's index within its chunk (see `corpus.ChunkText.indices`)."""


@dataclasses.dataclass
class ChunkResult:
    chunk: int
    bytes: int
    documents: int
    empty_documents: int
    replaced_bytes: int
    pieces: dict[str, StreamPiece]


@dataclasses.dataclass(frozen=True)
class _WorkerSettings:
    tokenizer_directory: str
    doc_unit: str
    jsonl_field: str
    strict: bool
    holdout: Holdout | None
    input_format: str = "text"


_worker: tuple[_WorkerSettings, Tokenizer, np.dtype] | None = None


def _start_worker(settings: _WorkerSettings, tokenizer: Tokenizer | None = None) -> None:
    """Load the tokenizer of a worker process (or, in this process, adopt the builder's)."""
    global _worker
    tokenizer = tokenizer or load_tokenizer(settings.tokenizer_directory)
    _worker = (settings, tokenizer, token_dtype(tokenizer.vocab_size))


def _tokenize_chunk(task: tuple[corpus.Chunk, tuple[tuple[str, int | None], ...]]) -> ChunkResult:
    """Documents of a chunk -> token arrays per split. ``task[1]`` gives, per split fed by the chunk, the index
    of its first document still to tokenise (None: the split already holds all of them)."""
    chunk, streams = task
    chunk = corpus.resolve(chunk)
    settings, tokenizer, dtype = _worker
    if (
        isinstance(tokenizer, WordTokenizer)
        and settings.doc_unit == "line"
        and not chunk.jsonl
        and len(streams) == 1
        and streams[0][1] == 0
        and settings.input_format != "wikitext"
    ):
        result = _tokenize_lines(chunk, streams[0][0], tokenizer, dtype)
        if result is not None:
            return result
    if (
        tokenizer.character_level
        and settings.doc_unit == "line"
        and not chunk.jsonl
        and len(streams) == 1
        and streams[0][1] is not None
    ):
        return _tokenize_characters(chunk, streams[0][0], streams[0][1], tokenizer, dtype)
    text = corpus.chunk_documents(
        chunk, settings.doc_unit, settings.jsonl_field, settings.strict, keep_blank=settings.input_format == "wikitext"
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


def _tokenize_lines(chunk: corpus.Chunk, split: str, tokenizer: WordTokenizer, dtype: np.dtype) -> ChunkResult | None:
    """The word tokenizer's fast path for one-document-per-line text (One Billion Word, PTB): the words are
    found and looked up with numpy (`txl_dist.word_scan`), about three times faster than ``str.split`` and a
    dict lookup per word. None for text it does not take (see `txl_dist.word_scan.scan_lines`)."""
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
    chunk: corpus.Chunk, split: str, first_document: int, tokenizer: Tokenizer, dtype: np.dtype
) -> ChunkResult:
    """The byte and character tokenizers' path: every line a document, blank lines included, nothing replaced
    or dropped, so the chunk's tokens are its bytes (characters) with a newline closing an unended last line.
    Documents before ``first_document`` (a resume inside the chunk) are left out."""
    data = chunk.data
    if tokenizer.kind == "byte":
        ids = np.frombuffer(data, dtype=np.uint8)
        is_space = _BYTE_IS_SPACE[ids]
    else:
        text, _ = corpus._decode(chunk, strict=True)  # a character alphabet has no stand-in for bad bytes
        try:
            ids = tokenizer.encode_text(text, where=f"{chunk.path}, the text from byte {chunk.start.offset}")
        except ValueError as error:  # a character outside the tokenizer's alphabet
            raise InputError(
                f"{error}; train the tokenizer on this text, or give it an --alphabet that holds it"
            ) from None
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


def _encode_piece(tokenizer: Tokenizer, text: corpus.ChunkText, selected: np.ndarray, dtype: np.dtype) -> StreamPiece:
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


# ---- parent side --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StreamPosition:
    """Where a split continues in its source: with document ``document`` of chunk ``chunk`` (or the first one
    after it), less its first ``skip_tokens`` tokens (a long document cut at a block boundary)."""

    chunk: int = 0
    document: int = 0
    skip_tokens: int = 0


class BlockPacker:
    """Packs a split's documents into blocks of at most ``tokens_per_block`` tokens, and blocks into shards.

    ``block_start`` is where the block being filled begins in the input; when the writer finishes a shard
    (its ``on_shard`` callback) that is where the split would continue after it.
    """

    def __init__(self, writer: Any, tokens_per_block: int, position: StreamPosition):
        self.writer = writer
        self.tokens_per_block = tokens_per_block
        self.block_start = position
        self._resume_inside = position if position.skip_tokens else None
        self._parts: list[np.ndarray] = []
        self._offsets: list[np.ndarray] = []
        self._length = self._words = self._characters = 0

    def add(self, chunk: int, piece: StreamPiece) -> None:
        count = len(piece.document_tokens)
        if not count:
            return
        ends = np.cumsum(piece.document_tokens)
        starts = ends - piece.document_tokens
        indices = piece.document_indices
        i = 0
        if self._resume_inside is not None:
            resume, self._resume_inside = self._resume_inside, None
            if (chunk, int(indices[0])) != (resume.chunk, resume.document):
                raise BuildError(
                    f"the input no longer matches the journal: the split should continue inside "
                    f"document {resume.document} of chunk {resume.chunk}"
                )
            self._add_long(
                piece.tokens[resume.skip_tokens : ends[0]],
                None,
                chunk,
                int(indices[0]),
                resume.skip_tokens,
                self._after(chunk, indices, 1),
            )
            i = 1
        while i < count:
            room = self.tokens_per_block - self._length
            fit = int(np.searchsorted(ends, starts[i] + room, side="right"))
            if fit > i:  # documents i..fit-1 fit whole in the current block
                self._append(
                    piece.tokens[starts[i] : ends[fit - 1]],
                    starts[i:fit] - starts[i],
                    int(piece.document_words[i:fit].sum()),
                    int(piece.document_characters[i:fit].sum()),
                )
                i = fit
                if self._length == self.tokens_per_block:
                    self._flush(self._after(chunk, indices, i))
            elif self._length:  # document i starts the next block
                self._flush(StreamPosition(chunk, int(indices[i])))
            else:  # document i alone is longer than a block
                self._add_long(
                    piece.tokens[starts[i] : ends[i]],
                    (int(piece.document_words[i]), int(piece.document_characters[i])),
                    chunk,
                    int(indices[i]),
                    0,
                    self._after(chunk, indices, i + 1),
                )
                i += 1

    @staticmethod
    def _after(chunk: int, indices: np.ndarray, i: int) -> StreamPosition:
        return StreamPosition(chunk, int(indices[i]) if i < len(indices) else int(indices[-1]) + 1)

    def _add_long(
        self,
        tokens: np.ndarray,
        begins: tuple[int, int] | None,
        chunk: int,
        document: int,
        skipped: int,
        after: StreamPosition,
    ) -> None:
        """A document (or, after a resume, the rest of one) that starts an empty block and may span several.
        ``begins`` holds its words and characters when the document begins here."""
        block = self.tokens_per_block
        position = 0
        while len(tokens) - position > block:
            self._append_part(tokens[position : position + block], begins if position == 0 else None)
            position += block
            self._flush(StreamPosition(chunk, document, skipped + position))
        self._append_part(tokens[position:], begins if position == 0 else None)
        if self._length == block:
            self._flush(after)

    def _append_part(self, tokens: np.ndarray, begins: tuple[int, int] | None) -> None:
        offsets = np.zeros(1 if begins else 0, dtype=np.int64)
        self._append(tokens, offsets, *(begins or (0, 0)))

    def _append(self, tokens: np.ndarray, offsets: np.ndarray, words: int, characters: int) -> None:
        self._parts.append(tokens)
        self._offsets.append(offsets + self._length)
        self._length += len(tokens)
        self._words += words
        self._characters += characters

    def _flush(self, next_start: StreamPosition | None) -> None:
        tokens, offsets = np.concatenate(self._parts), np.concatenate(self._offsets)
        words, characters = self._words, self._characters
        self._parts, self._offsets = [], []
        self._length = self._words = self._characters = 0
        self.block_start = next_start
        self.writer.add_block(tokens, offsets, words=words, characters=characters)

    def close(self) -> list[ShardEntry]:
        if self._length:
            self._flush(None)
        return self.writer.close()


@dataclasses.dataclass
class BuildSummary:
    output: Path
    documents: int
    tokens: int
    empty_documents: int
    replaced_bytes: int
    shards: int
    seconds: float
    bytes_read: int
    """Input bytes read by this run (a resumed run reads less than the whole input)."""

    def line(self) -> str:
        rate = self.bytes_read / 1e6 / max(self.seconds, 1e-9)
        return (
            f"build_shards: {self.documents:,} documents, {self.tokens:,} tokens, {self.empty_documents:,} "
            f"empty documents skipped, {self.replaced_bytes:,} non-UTF-8 bytes replaced, {self.shards} shards "
            f"in {self.output}, {self.seconds:.2f} s, {rate:.1f} MB/s"
        )


_STATISTICS = ("bytes", "documents", "empty_documents", "replaced_bytes")


def _shorten(value: Any, limit: int = 120) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


class _Journal:
    """The resume state in OUT/.build_state.json."""

    def __init__(self, path: Path, state: dict[str, Any]):
        self.path = path
        self.state = state

    @classmethod
    def new(cls, path: Path, settings: BuildSettings, record: dict[str, Any]) -> _Journal:
        state = {
            "settings": record,
            "sources": {
                source: {
                    "done": False,
                    "read_from": dataclasses.asdict(ReadPosition()),
                    "statistics_next_chunk": 0,
                    "statistics": dict.fromkeys(_STATISTICS, 0),
                }
                for source in settings.sources
            },
            # position: where the split continues in its source; null once its last shard is written.
            "streams": {
                split: {"position": dataclasses.asdict(StreamPosition()), "shards": []} for split in settings.splits()
            },
        }
        journal = cls(path, state)
        journal.save()
        return journal

    @classmethod
    def load(cls, path: Path, record: dict[str, Any]) -> _Journal:
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            journaled = state["settings"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise BuildError(f"{path}: unreadable resume state ({error}); start again with --overwrite") from error
        if journaled != record:
            differing = sorted(key for key in set(journaled) | set(record) if journaled.get(key) != record.get(key))
            details = "; ".join(
                f"{key}: journal {_shorten(journaled.get(key))}, now {_shorten(record.get(key))}" for key in differing
            )
            raise BuildError(
                f"{path}: the interrupted build used other settings ({', '.join(differing)} differ: {details}); "
                f"resume with the same settings and inputs, or start again with --overwrite"
            )
        return cls(path, state)

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.state, indent=1) + "\n")

    def shards(self, split: str) -> list[ShardEntry]:
        return [ShardEntry(**entry) for entry in self.state["streams"][split]["shards"]]


class _Builder:
    def __init__(self, settings: BuildSettings, output: Path, workers: int, progress: bool):
        if workers < 1:
            raise BuildError(f"--workers {workers}: must be at least 1")
        self.settings = settings
        self.output = output
        self.workers = workers
        self.progress = progress
        self.tokenizer = load_tokenizer(settings.tokenizer_directory)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.record = settings.record(self.tokenizer)
        self.bytes_read = 0

    def run(self, resume: bool, overwrite: bool, allow_empty: bool = False) -> BuildSummary:
        # Imported here: webdataset imports torch, which spawned tokenising workers (importing this module) need not.
        from data_tools.shard_writer import ShardWriter

        started = time.perf_counter()
        # Before anything in the output is deleted: a shard of the previous build given as an input would be gone.
        inputs = [
            f.name
            for files in self.settings.sources.values()
            for f in files
            if not f.name.startswith(corpus.TREEBANK_PREFIX)
        ]
        try:
            refuse_output_over_inputs(self.output, inputs)
        except OutputPathError as error:
            raise BuildError(str(error)) from None
        journal = self._prepare_output(resume, overwrite)
        # The heap of the imports (torch's, through webdataset) never becomes garbage; leaving it out of the
        # collector's passes makes the single-process build ~10% faster.
        gc.freeze()
        try:
            for source in self.settings.sources:
                if not journal.state["sources"][source]["done"]:
                    self._build_source(source, journal, ShardWriter)
        finally:
            gc.unfreeze()
        manifest = self._manifest(journal)
        empty = [name for name, split in manifest.splits.items() if split.documents == 0]
        if empty and not allow_empty:
            raise BuildError(
                f"split {empty[0]!r} has no documents (its inputs are empty or blank): no manifest "
                f"written; check the inputs, or pass --allow-empty to write empty splits"
            )
        write_manifest(self.output, manifest)
        journal.path.unlink()
        statistics = [journal.state["sources"][s]["statistics"] for s in self.settings.sources]
        return BuildSummary(
            output=self.output,
            documents=sum(split.documents for split in manifest.splits.values()),
            tokens=sum(split.tokens for split in manifest.splits.values()),
            empty_documents=sum(s["empty_documents"] for s in statistics),
            replaced_bytes=sum(s["replaced_bytes"] for s in statistics),
            shards=sum(len(split.shards) for split in manifest.splits.values()),
            seconds=time.perf_counter() - started,
            bytes_read=self.bytes_read,
        )

    def _prepare_output(self, resume: bool, overwrite: bool) -> _Journal:
        if resume and overwrite:
            raise BuildError("--resume and --overwrite exclude each other")
        output = self.output
        if output.exists() and not output.is_dir():
            raise BuildError(f"{output}: exists and is not a directory")
        output.mkdir(parents=True, exist_ok=True)
        state_path = output / STATE_NAME
        if resume and state_path.exists():
            journal = _Journal.load(state_path, self.record)
            self._check_journaled_shards(journal)
            return journal
        entries = sorted(p.name for p in output.iterdir())
        if entries and resume:
            if (output / MANIFEST_NAME).exists():
                raise BuildError(f"{output}: the build is complete ({MANIFEST_NAME} exists), nothing to resume")
            raise BuildError(f"{output}: no {STATE_NAME} to resume from; start again with --overwrite")
        if entries and not overwrite:
            raise BuildError(
                f"{output}: not empty ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); "
                f"pass --overwrite to replace its shards, or --resume to continue an interrupted build"
            )
        for name in entries:
            if name in (MANIFEST_NAME, STATE_NAME) or OUTPUT_FILE.match(name):
                (output / name).unlink()
        return _Journal.new(state_path, self.settings, self.record)

    def _check_journaled_shards(self, journal: _Journal) -> None:
        journaled = set()
        for split in self.settings.splits():
            for entry in journal.shards(split):
                path = self.output / entry.path
                journaled.add(entry.path)
                if not path.is_file():
                    raise BuildError(
                        f"{path}: missing, but {journal.path} lists it as written; start again with --overwrite"
                    )
                actual = sha256_file(path)
                if actual != entry.sha256:
                    raise BuildError(
                        f"{path}: sha256 {actual} differs from {entry.sha256} in {journal.path}; the shard "
                        f"changed after it was written: start again with --overwrite"
                    )
        # Shards written after the last journal entry (and partial files) are rewritten identically.
        for path in self.output.iterdir():
            if OUTPUT_FILE.match(path.name) and path.name not in journaled:
                path.unlink()

    def _build_source(self, source: str, journal: _Journal, writer_class: type) -> None:
        settings = self.settings
        splits = settings.streams_of(source)
        source_state = journal.state["sources"][source]
        stream_states = {split: journal.state["streams"][split] for split in splits}
        files = settings.sources[source]
        read_from = ReadPosition(**source_state["read_from"])
        statistics_from = source_state["statistics_next_chunk"]
        chunk_starts: dict[int, ReadPosition] = {}

        def on_shard(split: str, entry: ShardEntry) -> None:
            stream = stream_states[split]
            stream["shards"].append(dataclasses.asdict(entry))
            position = packers[split].block_start
            stream["position"] = dataclasses.asdict(position) if position else None
            # Re-reading restarts at the chunk where the split furthest behind continues.
            earliest = min(
                (StreamPosition(**s["position"]).chunk for s in stream_states.values() if s["position"] is not None),
                default=None,
            )
            if earliest is not None:
                source_state["read_from"] = dataclasses.asdict(chunk_starts[earliest])
                for chunk in [c for c in chunk_starts if c < earliest]:
                    del chunk_starts[chunk]
            journal.save()

        packers: dict[str, BlockPacker] = {}
        positions = {
            split: StreamPosition(**stream_states[split]["position"])
            for split in splits
            if stream_states[split]["position"] is not None
        }
        writers = {}
        for split in splits:
            done = journal.shards(split)
            writers[split] = writer_class(
                self.output,
                split,
                self.tokenizer.vocab_size,
                self.dtype,
                settings.tokens_per_shard,
                first_shard_index=len(done),
                first_token_offset=sum(s.tokens for s in done),
                first_block_offset=sum(s.blocks for s in done),
                on_shard=lambda entry, split=split: on_shard(split, entry),
            )
            packers[split] = BlockPacker(
                writers[split], settings.tokens_per_block, positions.get(split, StreamPosition())
            )

        # This process tokenises too, with the builder's tokenizer. A spawned worker costs seconds to start (a
        # million-word vocabulary to load): a small source (One Billion Word's valid and test files) is
        # tokenised here alone.
        workers = self.workers if sum(f.size for f in files) >= SMALL_SOURCE_CHUNKS * settings.chunk_bytes else 1

        def tasks() -> Iterator[tuple[corpus.Chunk, tuple[tuple[str, int | None], ...]]]:
            for chunk in corpus.read_chunks(files, settings.doc_unit, settings.chunk_bytes, read_from):
                index = chunk.start.chunk
                chunk_starts[index] = chunk.start
                firsts = []
                for split in splits:
                    position = positions.get(split)
                    if position is None or position.chunk > index:
                        firsts.append((split, None))
                    else:
                        firsts.append((split, position.document if position.chunk == index else 0))
                yield corpus.portable(chunk) if workers > 1 else chunk, tuple(firsts)

        plain = all(not f.name.endswith(".gz") for f in files)
        bar = tqdm(
            total=sum(f.size for f in files) if plain else None,
            initial=sum(f.size for f in files[: read_from.file]) + read_from.offset if plain else 0,
            unit="B",
            unit_scale=True,
            desc=f"{source}",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        )
        worker_settings = _WorkerSettings(
            str(settings.tokenizer_directory),
            settings.doc_unit,
            settings.jsonl_field,
            settings.strict,
            settings.holdout,
            input_format=settings.input_format,
        )
        totals = source_state["statistics"]
        counted = {split: [0, 0] for split in splits}  # documents, tokens (of this run, for the progress bar)
        results = ordered_map(
            _tokenize_chunk,
            tasks(),
            workers,
            _start_worker,
            (worker_settings,),
            local_initargs=(worker_settings, self.tokenizer),
        )
        try:
            for result in results:
                for split, piece in result.pieces.items():
                    packers[split].add(result.chunk, piece)
                    counted[split][0] += len(piece.document_tokens)
                    counted[split][1] += len(piece.tokens)
                if result.chunk >= statistics_from:
                    for key in _STATISTICS:
                        totals[key] += getattr(result, key)
                    source_state["statistics_next_chunk"] = result.chunk + 1
                self.bytes_read += result.bytes
                bar.update(result.bytes)
                bar.set_postfix(
                    documents=sum(c[0] for c in counted.values()),
                    tokens=sum(c[1] for c in counted.values()),
                    refresh=False,
                )
            for split in splits:
                packers[split].close()
                stream_states[split]["position"] = None
        except BaseException:
            for writer in writers.values():
                writer.__exit__(*sys.exc_info())
            raise
        finally:
            results.close()  # stops the workers now, also on an error
            bar.close()
        source_state["done"] = True
        journal.save()

    def _manifest(self, journal: _Journal) -> Manifest:
        splits = {}
        for split in self.settings.splits():
            shards = journal.shards(split)
            splits[split] = SplitEntry(
                documents=sum(s.documents for s in shards),
                tokens=sum(s.tokens for s in shards),
                blocks=sum(s.blocks for s in shards),
                shards=shards,
                words=sum(s.words for s in shards),
                characters=sum(s.characters for s in shards),
            )
        build = {
            **self.record,
            "tokenizer_directory": str(self.settings.tokenizer_directory),
            "statistics": {s: journal.state["sources"][s]["statistics"] for s in self.settings.sources},
        }
        return Manifest(
            tokenizer=TokenizerIdentity(**self.tokenizer.identity()),
            dtype=self.dtype.name,
            block_tokens=self.settings.tokens_per_block,
            splits=splits,
            build=build,
        )


def build_shards(
    settings: BuildSettings,
    output: str | Path,
    *,
    workers: int = 1,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    allow_empty: bool = False,
) -> BuildSummary:
    """Build (or with ``resume`` finish) the shards of ``settings`` in ``output``; see the module docstring."""
    return _Builder(settings, Path(output), workers, progress).run(resume, overwrite, allow_empty)


# ---- command line -------------------------------------------------------------------------------------------


def _parse_split(text: str) -> tuple[str, list[str]]:
    name, equals, patterns = text.partition("=")
    if not equals or not name or not patterns:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=GLOB[,GLOB...], e.g. train='data/*.txt'")
    return name, [p for p in patterns.split(",") if p]


def _parse_holdout(text: str) -> Holdout:
    name, equals, fraction = text.partition("=")
    try:
        return Holdout(name, float(fraction))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=FRACTION, e.g. valid=0.01") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m data_tools.build_shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tokenizer", required=True, type=Path, help="tokenizer directory (data_tools.train_tokenizer)"
    )
    parser.add_argument("--output", required=True, type=Path, help="directory for the shards and manifest.json")
    parser.add_argument(
        "--format",
        choices=corpus.FORMATS,
        default="text",
        help="text: --split NAME=GLOB inputs; lm1b: the One Billion Word r13output directory "
        "(--input); ptb: the Penn Treebank (--input DIR, or the treebank package)",
    )
    parser.add_argument(
        "--split",
        action="append",
        type=_parse_split,
        default=[],
        metavar="NAME=GLOB[,GLOB]",
        help="a split and its input files (text/.gz/.jsonl); repeat for more splits",
    )
    parser.add_argument(
        "--input",
        type=Path,
        help="the corpus directory for --format lm1b|ptb|wikitext; the file, "
        "its zip or their directory for --format enwik8|text8",
    )
    parser.add_argument(
        "--held-out-bytes",
        type=int,
        default=corpus.HELD_OUT_BYTES,
        help="--format enwik8|text8: bytes of valid and of test at the end of the file (the "
        "authors' 5,000,000; smaller for a scaled-down copy)",
    )
    parser.add_argument(
        "--lm1b-valid",
        default=corpus.LM1B_DEFAULT_VALID_FILE,
        help="heldout file used as the lm1b valid split (never the test file heldout-00000)",
    )
    parser.add_argument(
        "--holdout",
        type=_parse_holdout,
        action="append",
        default=[],
        metavar="NAME=FRACTION",
        help="draw split NAME from the train documents by a hash of each document (once per build)",
    )
    parser.add_argument("--doc-per", choices=corpus.DOC_UNITS, help="what a document is in text inputs (default: line)")
    parser.add_argument("--jsonl-field", default="text", help="field of a .jsonl record that holds the document")
    parser.add_argument("--strict", action="store_true", help="fail on non-UTF-8 bytes instead of replacing them")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenising processes, this one included (it takes a chunk when the others are busy)",
    )
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        default=DEFAULT_TOKENS_PER_BLOCK,
        help="most tokens of a block (one webdataset sample)",
    )
    parser.add_argument(
        "--tokens-per-shard",
        type=int,
        default=DEFAULT_TOKENS_PER_SHARD,
        help="a shard is closed after the block that reaches this many tokens",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=corpus.DEFAULT_CHUNK_BYTES,
        help="bytes of text per unit of work sent to a worker",
    )
    parser.add_argument("--resume", action="store_true", help="continue an interrupted build in --output")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards of a previous build in --output")
    parser.add_argument(
        "--allow-empty",
        action="store_true",
        help="write the manifest even when a split has no document (otherwise an error)",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> BuildSettings:
    if len(args.holdout) > 1:
        given = ", ".join(f"{h.split}={h.fraction}" for h in args.holdout)
        raise BuildError(
            f"--holdout is given {len(args.holdout)} times ({given}): a build draws one held-out split; "
            f"give the other splits their own inputs (--split NAME=GLOB)"
        )
    if args.format == "text":
        if args.input is not None:
            raise BuildError("--input is for --format lm1b|ptb; give text inputs with --split NAME=GLOB")
        sources: dict[str, list[InputFile]] = {}
        for name, patterns in args.split:
            sources.setdefault(name, []).extend(corpus.input_files(patterns))
    else:
        if args.split:
            raise BuildError(f"--split is for --format text; --format {args.format} defines train/valid/test")
        if args.doc_per not in (None, "line"):
            raise BuildError(f"--doc-per {args.doc_per}: --format {args.format} has one sentence per line")
        if args.format == "lm1b":
            if args.input is None:
                raise BuildError("--format lm1b needs --input DIR (the r13output directory)")
            sources = corpus.lm1b_splits(args.input, args.lm1b_valid)
        elif args.format in ("enwik8", "text8", "wikitext"):
            sources = benchmark_sources(args.format, args.input, args.held_out_bytes)
        else:
            sources = corpus.ptb_splits(args.input)
    return BuildSettings(
        tokenizer_directory=args.tokenizer.resolve(),
        sources=sources,
        input_format=args.format,
        doc_unit=args.doc_per or "line",
        jsonl_field=args.jsonl_field,
        strict=args.strict,
        holdout=args.holdout[0] if args.holdout else None,
        tokens_per_block=args.tokens_per_block,
        tokens_per_shard=args.tokens_per_shard,
        chunk_bytes=args.chunk_bytes,
    )


def benchmark_sources(input_format: str, path: Path | None, held_out_bytes: int) -> dict[str, list[InputFile]]:
    """The splits of ``--format enwik8|text8|wikitext`` (see `data_tools.corpus`)."""
    if path is None:
        what = (
            "the folder of wiki.*.tokens"
            if input_format == "wikitext"
            else f"{input_format}, {input_format}.zip or their folder"
        )
        raise BuildError(f"--format {input_format} needs --input ({what})")
    if input_format == "wikitext":
        return corpus.wikitext_splits(path)
    splits = corpus.enwik8_splits if input_format == "enwik8" else corpus.text8_splits
    return splits(path, held_out_bytes)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
        summary = build_shards(
            settings,
            args.output,
            workers=args.workers,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=args.progress,
            allow_empty=args.allow_empty,
        )
    except (BuildError, InputError, TokenizerError, ManifestError, WorkerError) as error:
        print(f"build_shards: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # no space, read-only output, a file where a folder should be
        print(f"build_shards: error: {describe_os_error(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build_shards: interrupted; the finished shards are kept: rerun with --resume", file=sys.stderr)
        return 130
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
