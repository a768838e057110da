"""Shards on disk (format) and the per-rank contiguous token streams read from them.

The names below are imported on first use (PEP 562): `txl_dist.data.format` is what the shard builder's
spawned workers import, and it must not pull in webdataset and torch (about a second and 300 MB per process)
through this package's ``__init__``.

Layer 2 (docs/architecture.md, Layers): may import layers 1-2; today only config, fileio and lazy_names; never
the rendezvous, the planner or anything above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from txl_dist.lazy_names import lazy_names

_HOMES = {
    "ManifestError": "txl_dist.data.format",
    "read_manifest": "txl_dist.data.format",
    "ShardError": "txl_dist.data.reader",
    "EvalBatch": "txl_dist.data.eval_streams",
    "EvalStreams": "txl_dist.data.eval_streams",
    "MicroBatch": "txl_dist.data.streams",
    "ResumeKind": "txl_dist.data.stream_state",
    "StreamStateError": "txl_dist.data.stream_state",
    "TrainStreams": "txl_dist.data.streams",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from txl_dist.data.eval_streams import EvalBatch, EvalStreams  # noqa: F401
    from txl_dist.data.format import ManifestError, read_manifest  # noqa: F401
    from txl_dist.data.reader import ShardError  # noqa: F401
    from txl_dist.data.stream_state import ResumeKind, StreamStateError  # noqa: F401
    from txl_dist.data.streams import MicroBatch, TrainStreams  # noqa: F401


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
