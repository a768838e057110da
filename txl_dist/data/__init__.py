"""Shards on disk (format) and the per-rank contiguous token streams read from them."""

from txl_dist.data.format import ManifestError, read_manifest
from txl_dist.data.reader import ShardError
from txl_dist.data.streams import (
    EvalBatch,
    EvalStreams,
    MicroBatch,
    ResumeKind,
    StreamStateError,
    TrainStreams,
)

__all__ = [
    "EvalBatch",
    "EvalStreams",
    "ManifestError",
    "MicroBatch",
    "ResumeKind",
    "ShardError",
    "StreamStateError",
    "TrainStreams",
    "read_manifest",
]
