"""Counting the words of chunks in worker processes, each over the chunks it is given, its totals handed over once.

Workers are spawned and import this module: keep its imports light (no torch).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from data_tools.corpora import chunking, text_decoding
from txl_dist import word_scan


@dataclasses.dataclass(frozen=True)
class CountSettings:
    doc_unit: str
    jsonl_field: str
    strict: bool


class WordCounts:
    """The words one process counted: short words as packed keys (`txl_dist.word_scan`) with their counts,
    merged into one sorted array whenever enough have piled up; longer words (bytes) and the words of chunks
    that took the ``str`` path in Counters."""

    MERGE_EVERY = 1 << 22  # keys piled up before a merge: ~64 MB of arrays at most

    def __init__(self) -> None:
        self.keys: list[np.ndarray] = []
        self.key_counts: list[np.ndarray] = []
        self.piled = 0
        self.long: collections.Counter = collections.Counter()
        self.text: collections.Counter = collections.Counter()

    def add_keys(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.keys.append(keys)
        self.key_counts.append(counts)
        self.piled += len(keys)
        if self.piled > self.MERGE_EVERY:
            self._merge()

    def _merge(self) -> None:
        keys, counts = word_scan.merge_counts(self.keys, self.key_counts)
        self.keys, self.key_counts, self.piled = [keys], [counts], 0

    def __getstate__(self) -> dict[str, Any]:
        self._merge()
        return self.__dict__

    @staticmethod
    def combine(parts: list[WordCounts]) -> collections.Counter:
        """The counts of several processes as one Counter of words (str)."""
        keys, counts = word_scan.merge_counts(
            [k for part in parts for k in part.keys], [c for part in parts for c in part.key_counts]
        )
        # Short and long words come from chunks that are valid UTF-8 split at ASCII whitespace: each is valid
        # UTF-8 on its own, and decodes to the str that str.split() gives.
        total = collections.Counter(
            dict(zip((word.decode("utf-8") for word in word_scan.unpack_keys(keys)), counts.tolist()))
        )
        for part in parts:
            for word, count in part.long.items():
                total[word.decode("utf-8")] += count
            total.update(part.text)
        return total


_counts: tuple[CountSettings, WordCounts] | None = None


def start_counting(settings: CountSettings) -> None:
    global _counts
    _counts = (settings, WordCounts())


def count_chunk(chunk: chunking.Chunk) -> dict[str, int]:
    """Count a chunk's words into this process's totals; returns the chunk's statistics."""
    settings, counts = _counts
    chunk = chunking.resolve(chunk)
    scan = None
    if settings.doc_unit == "line" and not chunk.jsonl:
        scan = word_scan.scan_lines(chunk.data)
    if scan is None:
        text = text_decoding.chunk_documents(chunk, settings.doc_unit, settings.jsonl_field, settings.strict)
        lines = [line for document in text.documents for line in document if line.strip()]
        counts.text.update(" ".join(lines).split())
        return {
            "documents": len(text.documents),
            "lines": len(lines),
            "empty_documents": text.empty,
            "replaced_bytes": text.replaced_bytes,
            "bytes": len(chunk.data),
        }
    short = scan.short()
    counts.add_keys(*word_scan.count_keys(scan.packed_keys(short)))
    long_words = np.flatnonzero(~short)
    if len(long_words):
        counts.long.update(scan.words(long_words))
    documents = int(np.count_nonzero(scan.words_per_line))
    return {
        "documents": documents,
        "lines": documents,
        "empty_documents": len(scan.words_per_line) - documents,
        "replaced_bytes": 0,
        "bytes": len(chunk.data),
    }


def counted() -> WordCounts:
    return _counts[1]
