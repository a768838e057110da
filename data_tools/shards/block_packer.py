"""Packing a split's documents into blocks of at most ``tokens_per_block`` tokens, deterministically.

Which documents share a block depends only on their token counts: a document that does not fit in what is left of
the current block starts the next one, and a document longer than a block spans as many blocks as it needs (the next
documents join its last block). The packer also knows where in the input the block being filled begins, which is
where a resumed build continues.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from data_tools.errors import InputError
from data_tools.shards.tokenize_chunks import StreamPiece
from txl_dist.data.format import ShardEntry


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
                raise InputError(
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
