"""What proves the input of an interrupted shard build: the sha256 of the bytes its finished shards were read from.

The journal (`data_tools.shards.journal`) records, with each finished shard, per input file of a source the sha256
of its bytes from its start up to the end of the chunk that the split furthest ahead continues in (decompressed
bytes for ``.gz`` and zip members, counted from the start of a byte range): every byte whose documents a finished
shard may hold. The builder reads every byte anyway; hashing them as they pass costs about 0.12 s per 100 MB.
``--resume`` reads those bytes again and compares: an input that changed there since the interruption, even by
one byte at the same size, is refused before anything in the output changes, because the shards already written
hold its old text. Bytes after that point may change (a byte that stopped a ``--strict`` build, fixed before the
resume). The finished build's manifest keeps the digests of the whole inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from data_tools.corpora.chunking import Chunk, ReadPosition
from data_tools.corpora.inputs import InputFile
from data_tools.errors import InputError

_READ_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Mark:
    """The hash at one place of the input: ``hashed`` bytes of file ``file`` (the files before it finished)."""

    file: int | None
    hashed: int
    hasher: Any


class InputDigests:
    """The running sha256 of the input files of one source, fed the chunks in the order they are read."""

    def __init__(self, files: list[InputFile]):
        self.files = files
        self._finished: dict[int, dict[str, Any]] = {}
        """Files hashed to their end (or, on a resume, checked and carried over from the journal)."""
        self._file: int | None = None
        self._hasher: Any = None
        self._hashed = 0

    def add(self, chunk: Chunk) -> None:
        """Hash a chunk's bytes: the next ones of its file (chunks come in order, without gaps)."""
        if chunk.start.file != self._file:
            if self._file is not None:
                self._finished[self._file] = self._entry(Mark(self._file, self._hashed, self._hasher))
            self._file, self._hasher, self._hashed = chunk.start.file, hashlib.sha256(), 0
        self._hasher.update(chunk.data)
        self._hashed += len(chunk.data)

    def mark(self) -> Mark:
        """The hash as it is now, to record later (`record`)."""
        return Mark(self._file, self._hashed, None if self._hasher is None else self._hasher.copy())

    def record(self, mark: Mark | None = None) -> list[dict[str, Any]]:
        """The digests up to ``mark`` (default: all that was read), as the journal and the manifest hold them."""
        mark = mark or self.mark()
        if mark.file is None:
            return []
        finished = [self._finished[index] for index in sorted(self._finished) if index < mark.file]
        return finished + [self._entry(mark)]

    def _entry(self, mark: Mark) -> dict[str, Any]:
        digest = (mark.hasher or hashlib.sha256()).hexdigest()
        return {"file": mark.file, "name": self.files[mark.file].name, "bytes": mark.hashed, "sha256": digest}

    @classmethod
    def resumed(
        cls, files: list[InputFile], recorded: list[dict[str, Any]], read_from: ReadPosition, journal: Path
    ) -> InputDigests:
        """The digests of a source that continues at ``read_from``, each recorded one checked against the input as
        it is now (an `InputError` naming the file when they differ). The file that reading continues in keeps its
        hash up to ``read_from``; files before it are finished; files after it are read again from their start."""
        digests = cls(files)
        for entry in recorded:
            index, count = int(entry["file"]), int(entry["bytes"])
            if not 0 <= index < len(files) or files[index].name != entry["name"]:
                raise InputError(f"{journal}: its input digests do not match the inputs; start again with --overwrite")
            input_file = files[index]
            resume_at = read_from.offset - input_file.start if index == read_from.file else None
            if resume_at is not None and resume_at > count:
                raise InputError(f"{journal}: continues past the input bytes it hashed; start again with --overwrite")
            hasher, kept = _hash_prefix(input_file, count, resume_at)
            if hasher.hexdigest() != entry["sha256"]:
                part = f"its first {count:,} bytes" if input_file.stop is None else f"{count:,} bytes of its range"
                raise InputError(
                    f"{input_file.name}: changed since the interrupted build (the sha256 of {part} differs from "
                    f"the one in {journal}); resume with the inputs as they were, or start again with --overwrite"
                )
            if index < read_from.file:
                digests._finished[index] = dict(entry)
            elif resume_at is not None:
                digests._file, digests._hasher, digests._hashed = index, kept, resume_at
        at = read_from.file
        if at < len(files) and digests._file is None and read_from.offset > files[at].start:
            raise InputError(f"{journal}: records no digest of {files[at].name}; start again with --overwrite")
        return digests


def _hash_prefix(input_file: InputFile, count: int, keep_at: int | None) -> tuple[Any, Any]:
    """(sha256 of the first ``count`` bytes of the input, a copy of the hash after its first ``keep_at`` bytes)."""
    hasher, kept = hashlib.sha256(), None
    position = 0
    with input_file.open() as handle:
        for stop in (keep_at, count):
            if stop is None:
                continue
            while position < min(stop, count):
                data = handle.read(min(_READ_BYTES, min(stop, count) - position))
                if not data:
                    return hasher, kept  # shorter than before: its digest differs
                hasher.update(data)
                position += len(data)
            if stop == keep_at:
                kept = hasher.copy()
    return hasher, kept
