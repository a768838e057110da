"""The resume state of a shard build (``OUT/.build_state.json``): what each source and split has done so far.

The file is JSON, rewritten atomically after each finished shard::

    {"settings": {...the build's settings, as BuildSettings.record gives them...},
     "sources": {SOURCE: {"done": false, "read_from": {ReadPosition}, "statistics_next_chunk": 0,
                          "statistics": {"bytes": 0, "documents": 0, "empty_documents": 0, "replaced_bytes": 0},
                          "inputs": [{"file": 0, "name": PATH, "bytes": N, "sha256": HEX}, ...]}},
     "streams": {SPLIT: {"position": {StreamPosition} or null, "shards": [{ShardEntry}, ...]}}}

A stream's ``position`` is where the split continues in its source, null once its last shard is written. A
source's ``inputs`` are the sha256 of the bytes read so far of each of its files (`data_tools.shards.input_digests`),
which ``--resume`` checks against the files as they are.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from data_tools.corpora.chunking import ReadPosition
from data_tools.errors import InputError
from data_tools.shards.block_packer import StreamPosition
from txl_dist.data.format import ShardEntry
from txl_dist.fileio import atomic_write_text, read_json

STATE_NAME = ".build_state.json"


@dataclasses.dataclass
class SourceStatistics:
    """What the chunks of a source held, each chunk counted once over interrupted runs."""

    bytes: int = 0
    documents: int = 0
    empty_documents: int = 0
    replaced_bytes: int = 0

    def add(self, result: Any) -> None:
        """Add a chunk's counts (a `ChunkResult`, which has the same fields)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(result, field.name))


@dataclasses.dataclass
class SourceState:
    """A source's progress: whether it is done, and the chunk its input is read again from on a resume."""

    done: bool = False
    read_from: ReadPosition = dataclasses.field(default_factory=ReadPosition)
    statistics_next_chunk: int = 0
    """The first chunk whose counts are not yet in ``statistics`` (a resume reads some chunks again)."""
    statistics: SourceStatistics = dataclasses.field(default_factory=SourceStatistics)
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The digests of the bytes read so far (`data_tools.shards.input_digests.InputDigests.record`)."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SourceState:
        # "inputs" is required: a journal without it (an older builder's) cannot prove its inputs unchanged.
        inputs = data["inputs"]
        if not isinstance(inputs, list) or not all(isinstance(entry, dict) for entry in inputs):
            raise TypeError(f"inputs is {type(inputs).__name__}, not a list of objects")
        return cls(
            done=bool(data["done"]),
            read_from=ReadPosition(**data["read_from"]),
            statistics_next_chunk=int(data["statistics_next_chunk"]),
            statistics=SourceStatistics(**data["statistics"]),
            inputs=inputs,
        )


@dataclasses.dataclass
class StreamState:
    """A split's progress: its finished shards, and where it continues in its source (None once complete)."""

    position: StreamPosition | None = dataclasses.field(default_factory=StreamPosition)
    shards: list[ShardEntry] = dataclasses.field(default_factory=list)
    shards_json: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)
    """``shards`` as JSON, kept beside them: the journal is saved after every shard, and converting every entry
    again each time made the saves cost a share of the build that grew with its shards."""

    def add_shard(self, entry: ShardEntry, position: StreamPosition | None) -> None:
        self.shards.append(entry)
        self.shards_json.append(dataclasses.asdict(entry))
        self.position = position

    def to_json(self) -> dict[str, Any]:
        position = None if self.position is None else dataclasses.asdict(self.position)
        return {"position": position, "shards": self.shards_json}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamState:
        position = data["position"]
        return cls(
            position=None if position is None else StreamPosition(**position),
            shards=[ShardEntry(**entry) for entry in data["shards"]],
            shards_json=list(data["shards"]),
        )


class BuildJournal:
    """The resume state in OUT/.build_state.json, for the build whose settings are ``record``."""

    def __init__(
        self,
        path: Path,
        record: dict[str, Any],
        sources: dict[str, SourceState],
        streams: dict[str, StreamState],
    ):
        self.path = path
        self.record = record
        self.sources = sources
        self.streams = streams

    @classmethod
    def new(cls, path: Path, record: dict[str, Any], sources: list[str], splits: list[str]) -> BuildJournal:
        """The state of a build that has not started, saved."""
        journal = cls(
            path, record, {source: SourceState() for source in sources}, {split: StreamState() for split in splits}
        )
        journal.save()
        return journal

    @classmethod
    def load(cls, path: Path, record: dict[str, Any]) -> BuildJournal:
        """The journal of an interrupted build; InputError when it is unreadable or its settings differ."""
        advice = "; start again with --overwrite"
        state = read_json(path, InputError, "unreadable resume state", advice)
        try:
            journaled = state["settings"]
            if not isinstance(journaled, dict):
                raise TypeError(f"settings is {type(journaled).__name__}, not an object")
            sources = {name: SourceState.from_json(data) for name, data in state["sources"].items()}
            streams = {name: StreamState.from_json(data) for name, data in state["streams"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise InputError(f"{path}: unreadable resume state ({error}){advice}") from error
        _refuse_other_settings(path, journaled, record)
        return cls(path, journaled, sources, streams)

    def save(self) -> None:
        state = {
            "settings": self.record,
            "sources": {name: dataclasses.asdict(source) for name, source in self.sources.items()},
            "streams": {name: stream.to_json() for name, stream in self.streams.items()},
        }
        atomic_write_text(self.path, json.dumps(state, indent=1) + "\n")

    def shards(self, split: str) -> list[ShardEntry]:
        return self.streams[split].shards

    def statistics(self, source: str) -> dict[str, int]:
        return dataclasses.asdict(self.sources[source].statistics)


def _refuse_other_settings(path: Path, journaled: dict[str, Any], record: dict[str, Any]) -> None:
    if journaled == record:
        return
    differing = sorted(key for key in set(journaled) | set(record) if journaled.get(key) != record.get(key))
    details = "; ".join(
        f"{key}: journal {_shorten(_differences_first(journaled.get(key), record.get(key)))}, "
        f"now {_shorten(_differences_first(record.get(key), journaled.get(key)))}"
        for key in differing
    )
    raise InputError(
        f"{path}: the interrupted build used other settings ({', '.join(differing)} differ: {details}); "
        f"resume with the same settings and inputs, or start again with --overwrite"
    )


def _differences_first(value: Any, other: Any) -> Any:
    """``value`` as it differs from ``other``: in a mapping the differing keys first, of a list of the same length
    only the differing items, so that what differs survives `_shorten` however long the rest (a deep path) is."""
    if isinstance(value, dict) and isinstance(other, dict):
        keys = sorted(value, key=lambda key: value[key] == other.get(key))  # stable: the differing ones first
        return {key: _differences_first(value[key], other.get(key)) for key in keys}
    if isinstance(value, list) and isinstance(other, list) and len(value) == len(other):
        return [_differences_first(item, theirs) for item, theirs in zip(value, other) if item != theirs]
    return value


def _shorten(value: Any, limit: int = 120) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."
