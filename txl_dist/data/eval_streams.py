"""Evaluation streams: one pass over a split in which every target token is scored exactly once across ranks.

The split (never shuffled) is cut into world_size x batch_size streams that share their boundary tokens; the last
windows are padded and masked, and every rank runs the same number of steps (see `EvalStreams`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator

import torch

from txl_dist.data.format import Manifest
from txl_dist.data.reader import BlockOrder, ShardStore
from txl_dist.data.stream_rows import StreamRows, check_positive, check_rank, open_split, row_buffer_tokens
from txl_dist.data.stream_spans import StreamSpans

logger = logging.getLogger("txl_dist.data")


@dataclasses.dataclass
class EvalBatch:
    """One evaluation window of one rank; only positions where ``mask`` is True are scored."""

    inputs: torch.Tensor
    """[batch_size, tgt_len] int64 token ids (padding where masked)."""
    targets: torch.Tensor
    """[batch_size, tgt_len] int64."""
    mask: torch.Tensor
    """[batch_size, tgt_len] bool: the targets to score."""
    stream_ids: torch.Tensor
    """[batch_size] int64 global stream ids of the rows."""
    reset_mems: bool
    """True on the first window of the pass."""
    step: int


class EvalStreams:
    """One pass over a split for evaluation; every target token is scored exactly once across ranks.

    The N tokens give N - 1 targets, shared out as evenly as possible among world_size x batch_size streams:
    stream s scores targets at positions (a_s, a_s + n_s] where a_s = sum of the n of the earlier streams, so it
    reads the n_s + 1 tokens [a_s, a_s + n_s]. `num_steps` is the same on every rank (rows run out at different
    steps and are then padded and masked), as ZeRO-3 needs every rank to run the same forwards.
    """

    def __init__(
        self,
        shards: str | os.PathLike,
        split: str,
        *,
        tgt_len: int,
        batch_size: int,
        world_size: int,
        rank: int,
        expected_fingerprint: str | None = None,
        verify_sha256: bool = False,
        manifest: Manifest | None = None,
    ):
        check_positive(tgt_len=tgt_len, batch_size=batch_size)
        check_rank(rank, world_size)
        self.manifest = open_split(shards, split, expected_fingerprint, manifest)
        self.split = split
        self.tgt_len = tgt_len
        self._store = ShardStore(shards, self.manifest, split, verify_sha256=verify_sha256)
        self.num_tokens = self.manifest.splits[split].tokens
        self.num_streams = world_size * batch_size
        targets = max(0, self.num_tokens - 1)
        per_stream, extra = divmod(targets, self.num_streams)
        ids = list(range(rank * batch_size, (rank + 1) * batch_size))
        self._starts = [s * per_stream + min(s, extra) for s in ids]
        self._lengths = [per_stream + (1 if s < extra else 0) for s in ids]
        self.num_targets = sum(self._lengths)
        self.num_steps = -(-(per_stream + (1 if extra else 0)) // tgt_len)
        self._rows = StreamRows(self._store, ids, row_buffer_tokens(tgt_len), self.manifest.tokenizer.eod_id)
        self._layout = StreamSpans([(0, self.num_tokens)], 1)
        self._order = BlockOrder(self._store.block_tokens)
        logger.info(
            "eval split '%s': %d targets in %d streams, %d steps of %d; this rank scores %d",
            split,
            targets,
            self.num_streams,
            self.num_steps,
            tgt_len,
            self.num_targets,
        )

    def __iter__(self) -> Iterator[EvalBatch]:
        rows, tgt_len = self._rows, self.tgt_len
        window_steps = (rows.buffer.shape[1] - 1) // tgt_len
        lengths = torch.tensor(self._lengths, dtype=torch.int64)
        columns = torch.arange(tgt_len)
        for first_step in range(0, self.num_steps, window_steps):
            offset = first_step * tgt_len
            steps = min(window_steps, self.num_steps - first_step)
            # A row with no targets reads nothing (its one token may lie past a tiny split's end).
            counts = [max(0, min(steps * tgt_len + 1, n + 1 - offset)) if n else 0 for n in self._lengths]
            rows.fill(self._layout, self._order, [a + offset for a in self._starts], counts)
            for window in range(steps):
                inputs, targets = rows.window(window * tgt_len, tgt_len)
                scored = lengths - (first_step + window) * tgt_len
                mask = columns.unsqueeze(0) < scored.unsqueeze(1)
                yield EvalBatch(
                    inputs, targets, mask, rows.stream_ids_tensor.clone(), first_step + window == 0, first_step + window
                )

    def close(self) -> None:
        """Release open remote shard streams."""
        self._rows.close()

    def __enter__(self) -> EvalStreams:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
