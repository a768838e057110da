"""Reading a split's streams into token windows: the split opened and checked, and row buffers filled from it.

What the training and the evaluation streams share. Each micro-batch slot is a `StreamRows`: one `StreamReader`
per stream (row) and one [rows, buffer] token buffer, refilled from the shards and cut into windows of
tgt_len + 1 tokens.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from txl_dist.data.format import Manifest, ManifestError, read_manifest
from txl_dist.data.reader import BlockOrder, ShardStore, StreamReader
from txl_dist.data.stream_spans import StreamSpans

# Windows are cut from per-row buffers of about this many tokens: refilling a row has a fixed cost in Python,
# which a long buffer spreads over many tokens.
BUFFER_TOKENS = 16384


def row_buffer_tokens(tgt_len: int) -> int:
    """Tokens of a row buffer: whole windows of tgt_len, about `BUFFER_TOKENS`, and the last window's target."""
    return max(1, BUFFER_TOKENS // tgt_len) * tgt_len + 1


def open_split(
    shards: str | os.PathLike, split: str, expected_fingerprint: str | None, manifest: Manifest | None = None
) -> Manifest:
    """The manifest of ``shards`` (``manifest``: read already by the caller), refused (`ManifestError`) without
    ``split`` or built with another tokenizer."""
    manifest = read_manifest(shards) if manifest is None else manifest
    where = os.path.join(os.fspath(shards), "manifest.json")
    if split not in manifest.splits:
        raise ManifestError(f"{where}: no split '{split}'; it has {sorted(manifest.splits)}")
    if expected_fingerprint is not None and expected_fingerprint != manifest.tokenizer.fingerprint:
        raise ManifestError(
            f"{where}: tokenizer fingerprint {manifest.tokenizer.fingerprint} differs from the configured "
            f"tokenizer's {expected_fingerprint}: these shards were built with another tokenizer"
        )
    return manifest


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_rank(rank: int, world_size: int) -> None:
    check_positive(world_size=world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank!r}")


class StreamRows:
    """The streams of one micro-batch slot: a [rows, buffer] token buffer refilled from their readers."""

    def __init__(self, store: ShardStore, stream_ids: list[int], buffer_tokens: int, pad_id: int):
        self.stream_ids = stream_ids
        self.stream_ids_tensor = torch.tensor(stream_ids, dtype=torch.int64)
        self.readers = [StreamReader(store) for _ in stream_ids]
        self.buffer = np.empty((len(stream_ids), buffer_tokens), dtype=store.dtype)
        self.pad_id = pad_id

    def fill(self, layout: StreamSpans, order: BlockOrder, starts: list[int], counts: list[int]) -> None:
        """Row b gets ``counts[b]`` tokens from layout position ``starts[b]``, then padding."""
        for row, (reader, start, count) in enumerate(zip(self.readers, starts, counts)):
            filled = 0
            for begin, end in layout.epoch_ranges(start, start + count):
                reader.copy(order, begin, end, self.buffer[row, filled : filled + end - begin])
                filled += end - begin
            self.buffer[row, filled:] = self.pad_id

    def window(self, first: int, tgt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the window of tgt_len + 1 buffered tokens from ``first``, as int64."""
        window = self.buffer[:, first : first + tgt_len + 1]
        return torch.from_numpy(window[:, :-1].astype(np.int64)), torch.from_numpy(window[:, 1:].astype(np.int64))

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
