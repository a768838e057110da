"""The saved position of the training streams: its format, what it must match to be loaded, and what a load did.

`TrainStreams.state_dict` writes a plain JSON-able dict: its format and version, the identity of what was read
(split, tokenizer, shard contents, seed and shuffle setting), the number of streams and the position within them.
`check_state` refuses one that this loader cannot continue, naming the key.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any

from txl_dist.data.format import Manifest

STATE_FORMAT = "txl_dist.streams"
STATE_VERSION = 1


class StreamStateError(ValueError):
    """A stream state that does not belong to this split, tokenizer, shard set or seed; the message says which."""


class ResumeKind(str, enum.Enum):
    """What `TrainStreams.load_state_dict` did, which tells the trainer what to do with the saved mems."""

    EXACT = "exact"
    """Same number of streams: every stream continues where it stopped; restore the mems by stream id."""
    REPARTITIONED = "repartitioned"
    """Another number of streams: the rest of the epoch was re-cut; the mems must start empty."""


def manifest_identity(manifest: Manifest, split: str) -> str:
    """sha256 of what a stream position refers to: the tokenizer and the split's shard contents, not their paths
    (shards moved to object storage keep their identity)."""
    shards = [[shard.sha256, shard.tokens, shard.blocks] for shard in manifest.splits[split].shards]
    text = json.dumps([manifest.tokenizer.fingerprint, shards], separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_state(state: Any, loader: dict[str, Any], num_tokens: int, where: str) -> None:
    """Refuse (`StreamStateError`) a ``state`` that is malformed or belongs to other data than the loader's.

    ``loader`` holds the loader's split, tokenizer_fingerprint, manifest_id, shuffle_blocks and seed (the keys of
    the state that must match); ``num_tokens`` is the split's length; ``where`` names its manifest in messages.
    """
    _check_format_and_numbers(state)
    _check_identity(state, loader, where)
    _check_spans(state.get("layout_spans"), num_tokens)


def _check_format_and_numbers(state: Any) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise StreamStateError(f"not a stream state: key 'format' must be {STATE_FORMAT!r}")
    if state.get("version") != STATE_VERSION:
        raise StreamStateError(f"stream state: version {state.get('version')!r}, this reader reads {STATE_VERSION}")
    for key in ("num_streams", "tgt_len"):
        if not isinstance(state.get(key), int) or state[key] <= 0:
            raise StreamStateError(f"stream state: key '{key}' must be a positive integer, got {state.get(key)!r}")
    for key in ("epoch", "step", "position", "seed"):
        if not isinstance(state.get(key), int) or state[key] < 0:
            raise StreamStateError(f"stream state: key '{key}' must be a non-negative integer, got {state.get(key)!r}")


def _check_identity(state: dict[str, Any], loader: dict[str, Any], where: str) -> None:
    mismatches = [
        ("split", "the state belongs to another split"),
        ("tokenizer_fingerprint", f"the state was saved with another tokenizer than the one of {where}"),
        ("manifest_id", f"the state was saved on other shards than those of {where} (rebuilt or changed)"),
        ("shuffle_blocks", "the epoch's block order would differ"),
    ]
    if loader["shuffle_blocks"]:  # the seed orders the blocks only when they are shuffled
        mismatches.append(("seed", "the epoch's block order would differ"))
    for key, why in mismatches:
        if state.get(key) != loader[key]:
            raise StreamStateError(
                f"stream state: key '{key}' is {state.get(key)!r}, this loader has {loader[key]!r}: {why}"
            )


def _check_spans(spans: Any, num_tokens: int) -> None:
    previous_end = 0
    if not isinstance(spans, list) or not spans:
        raise StreamStateError("stream state: key 'layout_spans' must be a non-empty list of [start, end]")
    for span in spans:
        if (
            not isinstance(span, (list, tuple))
            or len(span) != 2
            or not all(isinstance(v, int) for v in span)
            or not previous_end <= span[0] < span[1] <= num_tokens
        ):
            raise StreamStateError(
                f"stream state: key 'layout_spans' has {span!r}; spans must increase within [0, {num_tokens}]"
            )
        previous_end = span[1]
