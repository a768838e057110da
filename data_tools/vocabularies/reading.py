"""The input a tokenizer's vocabulary is built from: its documents line by line or chunk by chunk (their words
counted by worker processes, `data_tools.vocabularies.word_counts`), with a progress bar and the counts for the
record."""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

from data_tools.corpora import character_documents, chunking, text_decoding
from data_tools.corpora.inputs import InputFile
from data_tools.errors import InputError
from data_tools.vocabularies.word_counts import CountSettings, WordCounts, count_chunk, counted, start_counting
from data_tools.workers import WorkerError, ordered_map


class Reading:
    """The documents of the inputs, line by line, with a progress bar and counts for the record."""

    def __init__(
        self,
        files: list[InputFile],
        doc_unit: str,
        jsonl_field: str,
        strict: bool,
        progress: bool,
        allow_empty: bool = False,
    ):
        self.files, self.doc_unit, self.jsonl_field, self.strict = files, doc_unit, jsonl_field, strict
        self.progress, self.allow_empty = progress, allow_empty
        self.statistics = {"documents": 0, "lines": 0, "empty_documents": 0, "replaced_bytes": 0, "bytes": 0}

    def line_batches(self) -> Iterator[list[str]]:
        """The non-blank lines of the non-empty documents, a chunk at a time."""
        plain = all(not f.name.endswith(".gz") for f in self.files)
        with tqdm(
            total=sum(f.size for f in self.files) if plain else None,
            unit="B",
            unit_scale=True,
            desc="reading",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        ) as bar:
            for chunk in chunking.read_chunks(self.files, self.doc_unit, chunking.DEFAULT_CHUNK_BYTES):
                text = text_decoding.chunk_documents(chunk, self.doc_unit, self.jsonl_field, self.strict)
                lines = [line for document in text.documents for line in document if line.strip()]
                statistics = self.statistics
                statistics["documents"] += len(text.documents)
                statistics["lines"] += len(lines)
                statistics["empty_documents"] += text.empty
                statistics["replaced_bytes"] += text.replaced_bytes
                statistics["bytes"] += len(chunk.data)
                bar.update(len(chunk.data))
                yield lines
        self._check_not_empty()

    def record(self) -> dict[str, Any]:
        return {"inputs": [f.describe() for f in self.files], "doc_per": self.doc_unit, "statistics": self.statistics}

    def count_words(self, workers: int) -> collections.Counter:
        """How often each whitespace-separated word occurs in the non-empty documents, counted by ``workers``
        processes (each counts the chunks it is given and hands over its totals once, at the end)."""
        if workers < 1:
            raise InputError(f"--workers {workers}: must be at least 1")
        plain = all(not f.name.endswith(".gz") for f in self.files)
        settings = CountSettings(self.doc_unit, self.jsonl_field, self.strict)
        chunks = chunking.read_chunks(self.files, self.doc_unit, chunking.DEFAULT_CHUNK_BYTES)
        if workers > 1:
            chunks = map(chunking.portable, chunks)
        totals: list[WordCounts] = []
        results = ordered_map(count_chunk, chunks, workers, start_counting, (settings,), finalizer=counted)
        try:
            with tqdm(
                total=sum(f.size for f in self.files) if plain else None,
                unit="B",
                unit_scale=True,
                desc="counting",
                file=sys.stderr,
                disable=not self.progress,
                dynamic_ncols=True,
            ) as bar:
                for result in results:
                    if isinstance(result, WordCounts):
                        totals.append(result)
                        continue
                    for key, value in result.items():
                        self.statistics[key] += value
                    bar.update(result["bytes"])
        except WorkerError as error:
            raise InputError(f"counting stopped: {error}") from error
        finally:
            results.close()
        self._check_not_empty()
        return WordCounts.combine(totals)

    def _check_not_empty(self) -> None:
        if self.statistics["documents"] == 0 and not self.allow_empty:
            # Raised from the end of the reading, before the tokenizer's files are written.
            names = ", ".join(str(f.name) for f in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
            raise InputError(
                f"no document in the input {names} ({len(self.files)} files, "
                f"{self.statistics['bytes']:,} bytes, {self.statistics['empty_documents']:,} blank "
                f"documents): check --input, or pass --allow-empty for a tokenizer of the special "
                f"symbols only"
            )

    def character_texts(self, what: str, kind: str) -> Iterator[tuple[chunking.Chunk, bytes | str]]:
        """Each chunk of the input and what a tokenizer of ``kind`` (byte, char) reads of it, every byte kept
        (`data_tools.corpora.character_documents`): a plain input's bytes (byte) or its UTF-8 text (char), each
        line a document; the text fields of a .jsonl input's records (as UTF-8 for byte), each ending with a
        newline. Counted in ``self.statistics``."""
        plain = all(not f.compressed for f in self.files)
        with tqdm(
            total=sum(f.size for f in self.files) if plain else None,
            unit="B",
            unit_scale=True,
            desc=what,
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        ) as bar:
            for chunk in chunking.read_chunks(self.files, "line", chunking.DEFAULT_CHUNK_BYTES):
                data: bytes | str
                if chunk.jsonl:
                    text = character_documents.chunk_documents(chunk, "line", self.jsonl_field, kind)
                    data = "".join(line + "\n" for document in text.documents for line in document)
                    if kind == "byte":
                        data = data.encode("utf-8", "surrogateescape")
                    documents, lines = len(text.documents), sum(map(len, text.documents))
                    self.statistics["empty_documents"] += text.empty
                else:
                    data = chunk.data if kind == "byte" else character_documents.decode(chunk, kind)
                    documents = lines = chunk.data.count(b"\n") + (not chunk.data.endswith(b"\n"))
                self.statistics["documents"] += documents
                self.statistics["lines"] += lines
                self.statistics["bytes"] += len(chunk.data)
                bar.update(len(chunk.data))
                yield chunk, data
        self._check_not_empty()
