"""Building the shards of a `BuildSettings`: the output folder, its journal, each source through the tokenising
workers, the block packers and the shard writers, and the manifest (see `data_tools.build_shards`)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from data_tools.command_line import describe_inputs
from data_tools.corpora import chunking
from data_tools.corpora.chunking import ReadPosition
from data_tools.corpora.inputs import TREEBANK_PREFIX
from data_tools.errors import InputError
from data_tools.shards.block_packer import BlockPacker, StreamPosition
from data_tools.shards.input_digests import InputDigests, Mark
from data_tools.shards.journal import STATE_NAME, BuildJournal
from data_tools.shards.settings import BuildSettings
from data_tools.shards.tokenize_chunks import ChunkResult, Task, WorkerSettings, start_worker, tokenize_chunk
from data_tools.workers import ordered_map
from txl_dist.data.format import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    SplitEntry,
    TokenizerIdentity,
    token_dtype,
    write_manifest,
)
from txl_dist.fileio import sha256_file
from txl_dist.output_folders import OutputPathError, refuse_output_over_inputs
from txl_dist.tokenizer import load_tokenizer

# Where a finished source "continues": past its last file, so that every file's digest is checked as finished.
_PAST_THE_END = ReadPosition(file=1 << 62)
SMALL_SOURCE_CHUNKS = 32  # a source of fewer chunks than this is tokenised without worker processes
# What a build writes in its output: shards, and their temporary files (".partial": an older builder's name).
OUTPUT_FILE = re.compile(r"^([A-Za-z0-9_]+-\d{6}\.tar|\..+\.(partial|tmp))$")


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
    read: str = ""
    """Which input was read (`describe_inputs`)."""

    def line(self) -> str:
        rate = self.bytes_read / 1e6 / max(self.seconds, 1e-9)
        return (
            f"build_shards: {self.documents:,} documents, {self.tokens:,} tokens, {self.empty_documents:,} "
            f"empty documents skipped, {self.replaced_bytes:,} non-UTF-8 bytes replaced, {self.shards} shards "
            f"in {self.output}, {self.seconds:.2f} s, {rate:.1f} MB/s; read {self.read}"
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
    """Build (or with ``resume`` finish) the shards of ``settings`` in ``output``; see `data_tools.build_shards`."""
    return _Builder(settings, Path(output), workers, progress).run(resume, overwrite, allow_empty)


class _Builder:
    def __init__(self, settings: BuildSettings, output: Path, workers: int, progress: bool):
        if workers < 1:
            raise InputError(f"--workers {workers}: must be at least 1")
        self.settings = settings
        self.output = output
        self.workers = workers
        self.progress = progress
        self.tokenizer = load_tokenizer(settings.tokenizer_directory)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.record = settings.record(self.tokenizer)
        self.bytes_read = 0
        self.digests = {source: InputDigests(files) for source, files in settings.sources.items()}
        """Per source, the sha256 of what has been read of its inputs (carried over from the journal on a resume)."""
        if settings.strict and self.tokenizer.kind == "byte":
            raise InputError(
                f"--strict: {settings.tokenizer_directory} is a byte tokenizer, which keeps every byte (those that "
                f"are not UTF-8 too): nothing is replaced for --strict to refuse; drop --strict"
            )

    def run(self, resume: bool, overwrite: bool, allow_empty: bool = False) -> BuildSummary:
        # lazy: webdataset imports torch (0.85 s), which neither build_shards --help (0.17 s) nor the spawned
        # tokenising workers, which import this module, need
        from data_tools.shards.writer import ShardWriter

        started = time.perf_counter()
        # Before anything in the output is deleted: a shard of the previous build given as an input would be gone.
        inputs = [
            f.name for files in self.settings.sources.values() for f in files if not f.name.startswith(TREEBANK_PREFIX)
        ]
        try:
            refuse_output_over_inputs(self.output, inputs)
        except OutputPathError as error:
            raise InputError(str(error)) from None
        journal = self._prepare_output(resume, overwrite)
        # The heap of the imports (torch's, through webdataset) never becomes garbage; leaving it out of the
        # collector's passes makes the single-process build faster.
        gc.freeze()
        try:
            for source in self.settings.sources:
                if not journal.sources[source].done:
                    _SourceBuild(self, source, journal, ShardWriter).run()
        finally:
            gc.unfreeze()
        manifest = self._manifest(journal)
        empty = [name for name, split in manifest.splits.items() if split.documents == 0]
        if empty and not allow_empty:
            raise InputError(
                f"split {empty[0]!r} has no documents (its inputs are empty or blank): no manifest "
                f"written; check the inputs, or pass --allow-empty to write empty splits"
            )
        write_manifest(self.output, manifest)
        journal.path.unlink()
        statistics = [journal.sources[s].statistics for s in self.settings.sources]
        return BuildSummary(
            output=self.output,
            documents=sum(split.documents for split in manifest.splits.values()),
            tokens=sum(split.tokens for split in manifest.splits.values()),
            empty_documents=sum(s.empty_documents for s in statistics),
            replaced_bytes=sum(s.replaced_bytes for s in statistics),
            shards=sum(len(split.shards) for split in manifest.splits.values()),
            seconds=time.perf_counter() - started,
            bytes_read=self.bytes_read,
            read=describe_inputs([f for files in self.settings.sources.values() for f in files]),
        )

    def _prepare_output(self, resume: bool, overwrite: bool) -> BuildJournal:
        if resume and overwrite:
            raise InputError("--resume and --overwrite exclude each other")
        output = self.output
        if output.exists() and not output.is_dir():
            raise InputError(f"{output}: exists and is not a directory")
        output.mkdir(parents=True, exist_ok=True)
        state_path = output / STATE_NAME
        if resume and state_path.exists():
            journal = BuildJournal.load(state_path, self.record)
            # Before anything in the output changes: the shards written hold the inputs' text as it was.
            self.digests = {
                source: InputDigests.resumed(
                    files,
                    journal.sources[source].inputs,
                    journal.sources[source].read_from if not journal.sources[source].done else _PAST_THE_END,
                    state_path,
                )
                for source, files in self.settings.sources.items()
            }
            self._check_journaled_shards(journal)
            return journal
        entries = sorted(p.name for p in output.iterdir())
        if entries and resume:
            if (output / MANIFEST_NAME).exists():
                raise InputError(f"{output}: the build is complete ({MANIFEST_NAME} exists), nothing to resume")
            raise InputError(f"{output}: no {STATE_NAME} to resume from; start again with --overwrite")
        if entries and not overwrite:
            raise InputError(
                f"{output}: not empty ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); "
                f"pass --overwrite to replace its shards, or --resume to continue an interrupted build"
            )
        for name in entries:
            if name in (MANIFEST_NAME, STATE_NAME) or OUTPUT_FILE.match(name):
                (output / name).unlink()
        return BuildJournal.new(state_path, self.record, list(self.settings.sources), self.settings.splits())

    def _check_journaled_shards(self, journal: BuildJournal) -> None:
        journaled = set()
        for split in self.settings.splits():
            for entry in journal.shards(split):
                path = self.output / entry.path
                journaled.add(entry.path)
                if not path.is_file():
                    raise InputError(
                        f"{path}: missing, but {journal.path} lists it as written; start again with --overwrite"
                    )
                actual = sha256_file(path)
                if actual != entry.sha256:
                    raise InputError(
                        f"{path}: sha256 {actual} differs from {entry.sha256} in {journal.path}; the shard "
                        f"changed after it was written: start again with --overwrite"
                    )
        # Shards written after the last journal entry (and partial files) are rewritten identically.
        for path in self.output.iterdir():
            if OUTPUT_FILE.match(path.name) and path.name not in journaled:
                path.unlink()

    def _manifest(self, journal: BuildJournal) -> Manifest:
        splits = {}
        for split in self.settings.splits():
            shards = journal.shards(split)
            splits[split] = SplitEntry(
                documents=sum(s.documents for s in shards),
                tokens=sum(s.tokens for s in shards),
                blocks=sum(s.blocks for s in shards),
                shards=list(shards),
                words=sum(s.words for s in shards),
                characters=sum(s.characters for s in shards),
            )
        build = {
            **self.record,
            "tokenizer_directory": str(self.settings.tokenizer_directory),
            "statistics": {s: journal.statistics(s) for s in self.settings.sources},
            "input_sha256": {s: journal.sources[s].inputs for s in self.settings.sources},
        }
        return Manifest(
            tokenizer=TokenizerIdentity(**self.tokenizer.identity()),
            dtype=self.dtype.name,
            block_tokens=self.settings.tokens_per_block,
            splits=splits,
            build=build,
        )


class _SourceBuild:
    """One source's chunks through the tokenising workers into the block packer and shard writer of each split it
    feeds, with the journal brought up to date after each finished shard."""

    def __init__(self, builder: _Builder, source: str, journal: BuildJournal, writer_class: type):
        settings = builder.settings
        self.builder = builder
        self.source = source
        self.journal = journal
        self.state = journal.sources[source]
        self.splits = settings.streams_of(source)
        self.files = settings.sources[source]
        self.digests = builder.digests[source]
        self.read_from = self.state.read_from
        self.statistics_from = self.state.statistics_next_chunk
        self.chunk_starts: dict[int, ReadPosition] = {}
        """Where each chunk read but not yet behind every split begins: a resume reads again from one of them."""
        self.marks: dict[int, tuple[Mark, Mark]] = {}
        """The input's hash before and after each chunk of ``chunk_starts`` (see `_proof_mark`)."""
        self.positions = {
            split: journal.streams[split].position for split in self.splits if journal.streams[split].position
        }
        self.writers = {split: self._writer(split, writer_class) for split in self.splits}
        self.packers = {
            split: BlockPacker(
                self.writers[split], settings.tokens_per_block, self.positions.get(split, StreamPosition())
            )
            for split in self.splits
        }
        # This process tokenises too, with the builder's tokenizer. A spawned worker costs seconds to start (a
        # million-word vocabulary to load): a small source (One Billion Word's valid and test files) is
        # tokenised here alone.
        small = sum(f.size for f in self.files) < SMALL_SOURCE_CHUNKS * settings.chunk_bytes
        self.workers = 1 if small else builder.workers
        self.documents = self.tokens = 0  # of this run, for the progress bar

    def _writer(self, split: str, writer_class: type):
        done = self.journal.shards(split)
        return writer_class(
            self.builder.output,
            split,
            self.builder.tokenizer.vocab_size,
            self.builder.dtype,
            self.builder.settings.tokens_per_shard,
            first_shard_index=len(done),
            first_token_offset=sum(s.tokens for s in done),
            first_block_offset=sum(s.blocks for s in done),
            on_shard=functools.partial(self._on_shard, split),
        )

    def _on_shard(self, split: str, entry: ShardEntry) -> None:
        self.journal.streams[split].add_shard(entry, self.packers[split].block_start)
        # Re-reading restarts at the chunk where the split furthest behind continues.
        positions = [self.journal.streams[s].position for s in self.splits]
        earliest = min((p.chunk for p in positions if p is not None), default=None)
        if earliest is not None:
            self.state.read_from = self.chunk_starts[earliest]
            for chunk in [c for c in self.chunk_starts if c < earliest]:
                del self.chunk_starts[chunk]
                del self.marks[chunk]
        self.state.inputs = self.digests.record(self._proof_mark(positions))
        self.journal.save()

    def _proof_mark(self, positions: list[StreamPosition | None]) -> Mark | None:
        """Where the bytes end that the finished shards may hold documents of: the end of the chunk that the split
        furthest ahead continues in (its start when the split holds nothing of it yet)."""
        ahead = [p for p in positions if p is not None]
        if not ahead:
            return None
        latest = max(ahead, key=lambda p: (p.chunk, p.document, p.skip_tokens))
        if latest.chunk not in self.marks:  # the chunk after the last one read: everything read so far
            return None
        before, after = self.marks[latest.chunk]
        return after if latest.document or latest.skip_tokens else before

    def run(self) -> None:
        settings = self.builder.settings
        worker_settings = WorkerSettings(
            str(settings.tokenizer_directory),
            settings.doc_unit,
            settings.jsonl_field,
            settings.strict,
            settings.holdout,
            input_format=settings.input_format,
        )
        bar = self._progress_bar()
        results = ordered_map(
            tokenize_chunk,
            self._tasks(),
            self.workers,
            start_worker,
            (worker_settings,),
            local_initargs=(worker_settings, self.builder.tokenizer),
        )
        try:
            for result in results:
                self._add(result, bar)
            for split in self.splits:
                self.packers[split].close()
                self.journal.streams[split].position = None
        except BaseException:
            for writer in self.writers.values():
                writer.__exit__(*sys.exc_info())
            raise
        finally:
            results.close()  # stops the workers now, also on an error
            bar.close()
        self.state.done = True
        self.state.inputs = self.digests.record()
        self.journal.save()

    def _tasks(self) -> Iterator[Task]:
        settings = self.builder.settings
        for chunk in chunking.read_chunks(self.files, settings.doc_unit, settings.chunk_bytes, self.read_from):
            index = chunk.start.chunk
            self.chunk_starts[index] = chunk.start
            before = self.digests.mark()
            self.digests.add(chunk)
            self.marks[index] = (before, self.digests.mark())
            firsts = []
            for split in self.splits:
                position = self.positions.get(split)
                if position is None or position.chunk > index:
                    firsts.append((split, None))
                else:
                    firsts.append((split, position.document if position.chunk == index else 0))
            yield chunking.portable(chunk) if self.workers > 1 else chunk, tuple(firsts)

    def _add(self, result: ChunkResult, bar: tqdm) -> None:
        for split, piece in result.pieces.items():
            self.packers[split].add(result.chunk, piece)
            self.documents += len(piece.document_tokens)
            self.tokens += len(piece.tokens)
        if result.chunk >= self.statistics_from:
            self.state.statistics.add(result)
            self.state.statistics_next_chunk = result.chunk + 1
        self.builder.bytes_read += result.bytes
        bar.update(result.bytes)
        bar.set_postfix(documents=self.documents, tokens=self.tokens, refresh=False)

    def _progress_bar(self) -> tqdm:
        files, read_from = self.files, self.read_from
        plain = all(not f.name.endswith(".gz") for f in files)
        return tqdm(
            total=sum(f.size for f in files) if plain else None,
            initial=sum(f.size for f in files[: read_from.file]) + read_from.offset if plain else 0,
            unit="B",
            unit_scale=True,
            desc=f"{self.source}",
            file=sys.stderr,
            disable=not self.builder.progress,
            dynamic_ncols=True,
        )
