"""Per-rank contiguous training streams: the batches that keep every rank's memory coherent, and their resume.

Training (`TrainStreams`). A split's token stream of N tokens (its blocks in manifest order, or in the epoch's
seeded block permutation with ``shuffle_blocks``) is cut into S = world_size x micro_batch x grad_accum streams
of L = floor(N / S) tokens: stream s is the span [s*L, (s+1)*L). Every optimizer step takes from every stream a
window of tgt_len + 1 tokens (inputs and targets shifted by one) and moves it forward by tgt_len, so row b of step
t+1 begins with the token that was the last target of row b of step t. An epoch has
floor((L - 1) / tgt_len) steps; the N - S*L tokens after the last stream and the last L - steps*tgt_len input
tokens of each stream are not trained on in that epoch (`dropped_tail_tokens`, logged once).

Rank r owns stream ids [r*mb*ga, (r+1)*mb*ga) (mb = micro_batch, ga = grad_accum); micro-batch slot k of rank r
holds the consecutive ids r*mb*ga + k*mb ... + mb-1, and each slot keeps its own mems. A rank therefore reads one
contiguous range of the token stream; each of its streams holds one decoded block and a buffer of about 16k tokens,
so memory per rank is bounded by micro_batch x grad_accum x (block size + 16k) tokens, whatever the corpus size.
Local shards are read in place at their blocks' byte offsets; URL shards (``pipe:``, ``http:``) through
webdataset, sequentially (see `txl_dist.data.reader` for what that costs, with ``shuffle_blocks`` above all).

Resume. The state is (epoch, position within the streams, S) plus the identity of what was read. With the same S
(whatever the world size, micro_batch or tgt_len) the streams continue exactly: stream s is stream s, and the mems
the training checkpoint keeps by stream id stay valid. With another S the rest of the epoch is re-partitioned:

    The tokens of the epoch not yet used as inputs are, in epoch order, the last L - position tokens of each old
    stream and the N - S*L tokens after the last one. These spans, concatenated in epoch order, are cut into the
    new S streams exactly as a whole split would be, and the epoch runs to its end on them; the next epoch is a
    fresh partition of the whole split. No input token is used twice and none is skipped beyond the new
    partition's own dropped tail. Where two old spans meet inside a new stream the text jumps (as at a document
    boundary without its separator), and mems start empty, so the loader logs a warning.

Evaluation reads its split otherwise: `txl_dist.data.eval_streams`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from txl_dist.data.format import Manifest
from txl_dist.data.reader import BlockOrder, ShardStore
from txl_dist.data.stream_rows import StreamRows, check_positive, check_rank, open_split, row_buffer_tokens
from txl_dist.data.stream_spans import StreamSpans
from txl_dist.data.stream_state import (
    STATE_FORMAT,
    STATE_VERSION,
    ResumeKind,
    StreamStateError,
    check_state,
    manifest_identity,
)

logger = logging.getLogger("txl_dist.data")


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of one rank: row b continues row b of the same slot at the previous step."""

    inputs: torch.Tensor
    """[micro_batch, tgt_len] int64 token ids."""
    targets: torch.Tensor
    """[micro_batch, tgt_len] int64: the inputs shifted by one."""
    slot: int
    """0..grad_accum-1: which micro-batch of this rank (each keeps its own mems)."""
    stream_ids: torch.Tensor
    """[micro_batch] int64 global stream ids of the rows."""
    reset_mems: bool
    """True on the first step of an epoch or of a re-partition: this slot's mems belong to other text."""
    epoch: int
    step: int
    """Optimizer step within the epoch (it keeps counting across a resume)."""


class TrainStreams:
    """The training batches of one rank: per optimizer step, ``grad_accum`` `MicroBatch`es in slot order, endless
    over epochs. See the module docstring for the partition and the resume rule.

    Example (one rank of four, 2 micro-batches of 8 rows per step)::

        streams = TrainStreams("shards/lm1b", "train", tgt_len=256, micro_batch=8, grad_accum=2,
                               world_size=4, rank=rank, shuffle_blocks=True, expected_fingerprint=fp)
        kind = streams.load_state_dict(saved) if saved else None
        for batch in streams:   # mems = mems_by_slot[batch.slot] unless batch.reset_mems
            ...
    """

    def __init__(
        self,
        shards: str | os.PathLike,
        split: str,
        *,
        tgt_len: int,
        micro_batch: int,
        grad_accum: int,
        world_size: int,
        rank: int,
        seed: int = 0,
        shuffle_blocks: bool = False,
        expected_fingerprint: str | None = None,
        verify_sha256: bool = False,
        manifest: Manifest | None = None,
    ):
        check_positive(tgt_len=tgt_len, micro_batch=micro_batch, grad_accum=grad_accum)
        check_rank(rank, world_size)
        self.manifest = open_split(shards, split, expected_fingerprint, manifest)
        self.split = split
        self.tgt_len = tgt_len
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle_blocks = shuffle_blocks
        self.manifest_id = manifest_identity(self.manifest, split)
        self._store = ShardStore(shards, self.manifest, split, verify_sha256=verify_sha256)
        self.num_streams = world_size * micro_batch * grad_accum
        self.num_tokens = self.manifest.splits[split].tokens
        fresh = StreamSpans([(0, self.num_tokens)], self.num_streams)
        if fresh.windows_left(0, tgt_len) == 0:
            raise ValueError(
                f"split '{split}' of {self._store.manifest_path} has {self.num_tokens} tokens: too few for "
                f"{self.num_streams} streams (world_size {world_size} x micro_batch {micro_batch} x grad_accum "
                f"{grad_accum}) of at least tgt_len + 1 = {tgt_len + 1} tokens"
            )
        self.tokens_per_stream = fresh.tokens_per_stream
        self.steps_per_epoch = fresh.windows_left(0, tgt_len)
        self.dropped_tail_tokens = self.num_tokens - self.num_streams * self.steps_per_epoch * tgt_len
        self._log_partition()
        first_id = rank * micro_batch * grad_accum
        self._slots = [
            StreamRows(
                self._store,
                list(range(first_id + k * micro_batch, first_id + (k + 1) * micro_batch)),
                row_buffer_tokens(tgt_len),
                self.manifest.tokenizer.eod_id,
            )
            for k in range(grad_accum)
        ]
        self._generation = 0
        self._start_epoch(0)

    def _log_partition(self) -> None:
        """One line on how the split is cut into streams and what an epoch does not train on."""
        logger.info(
            "split '%s': %d tokens in %d streams of %d tokens, %d steps of %d tokens per epoch; %d tokens (%.3f%%) "
            "not trained on per epoch (%d after the last stream, %d at the end of each stream)",
            self.split,
            self.num_tokens,
            self.num_streams,
            self.tokens_per_stream,
            self.steps_per_epoch,
            self.tgt_len,
            self.dropped_tail_tokens,
            100.0 * self.dropped_tail_tokens / self.num_tokens,
            self.num_tokens - self.num_streams * self.tokens_per_stream,
            self.tokens_per_stream - self.steps_per_epoch * self.tgt_len,
        )

    def stream_ids(self, slot: int) -> list[int]:
        """The global stream ids of this rank's micro-batch ``slot``, in row order."""
        return list(self._slots[slot].stream_ids)

    def slot_stream_ids(self) -> list[list[int]]:
        """`stream_ids` of every slot, slot by slot."""
        return [self.stream_ids(slot) for slot in range(len(self._slots))]

    def rank_stream_ids(self) -> list[int]:
        """Every stream id this rank owns, slot by slot and in row order within a slot: the column order of the
        memory a checkpoint stores for the rank (`txl_dist.training.train_state.SlotMemories.for_checkpoint`)."""
        return [stream for ids in self.slot_stream_ids() for stream in ids]

    @property
    def epoch(self) -> int:
        """The epoch of the next step (it moves on as the last micro-batch of an epoch is handed out)."""
        return self._epoch

    def _start_epoch(self, epoch: int) -> None:
        self._epoch, self._step, self._position = epoch, 0, 0
        self._layout = StreamSpans([(0, self.num_tokens)], self.num_streams)
        self._order = BlockOrder.for_epoch(
            self._store.block_tokens, shuffle=self.shuffle_blocks, seed=self.seed, epoch=epoch
        )

    def _settle(self) -> None:
        """Move on to the next epoch while the current layout has no window left."""
        while self._layout.windows_left(self._position, self.tgt_len) == 0:
            if self._position == 0:
                logger.warning(
                    "epoch %d: the %d tokens left to re-partition are too few for %d streams of %d tokens; "
                    "starting epoch %d",
                    self._epoch,
                    self._layout.total,
                    self.num_streams,
                    self.tgt_len + 1,
                    self._epoch + 1,
                )
            self._start_epoch(self._epoch + 1)

    def __iter__(self) -> Iterator[MicroBatch]:
        """Batches from the current position. A new iterator (or `load_state_dict`) ends the previous one; a step
        left half-taken is taken again from its first slot."""
        self._generation += 1
        generation = self._generation
        window_steps = (self._slots[0].buffer.shape[1] - 1) // self.tgt_len
        while True:
            self._settle()
            layout, order, epoch = self._layout, self._order, self._epoch
            steps = min(window_steps, layout.windows_left(self._position, self.tgt_len))
            count = steps * self.tgt_len + 1
            for rows in self._slots:
                starts = [layout.stream_start(s) + self._position for s in rows.stream_ids]
                rows.fill(layout, order, starts, [count] * len(starts))
            for window in range(steps):
                reset_mems, step = self._position == 0, self._step
                for slot, rows in enumerate(self._slots):
                    inputs, targets = rows.window(window * self.tgt_len, self.tgt_len)
                    batch = MicroBatch(inputs, targets, slot, rows.stream_ids_tensor.clone(), reset_mems, epoch, step)
                    if slot + 1 == self.grad_accum:
                        # Advance before handing out the last micro-batch, so that state_dict() taken after the
                        # optimizer step points at the next step.
                        self._position += self.tgt_len
                        self._step += 1
                        self._settle()
                    yield batch
                    if self._generation != generation:
                        raise RuntimeError("this iterator was superseded by a newer one or by load_state_dict()")

    def skip(self, steps: int) -> int:
        """Move every stream on by ``steps`` optimizer steps without reading them, exactly as taking them would
        (into the next epoch where this one ends): a data window passed over (`txl_dist.training.numerics`). The
        text jumps, so the caller empties the memories. Iterators made before this call stop with an error;
        iterate anew. Returns the tokens passed over, every stream's together."""
        check_positive(steps=steps)
        self._generation += 1
        for _ in range(steps):
            self._settle()
            self._position += self.tgt_len
            self._step += 1
        self._settle()
        return steps * self.tgt_len * self.num_streams

    def state_dict(self) -> dict[str, Any]:
        """The position after the last optimizer step whose micro-batches were all handed out, as a plain JSON-able
        dict. A step handed out in part (no optimizer update can have used it) is handed out again, whole, after a
        resume. A batch the trainer took but did not train on counts as consumed: to stop at an epoch's end, check
        `epoch` before taking the next step's first micro-batch."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "split": self.split,
            "tokenizer_fingerprint": self.manifest.tokenizer.fingerprint,
            "manifest_id": self.manifest_id,
            "num_streams": self.num_streams,
            "seed": self.seed,
            "shuffle_blocks": self.shuffle_blocks,
            "tgt_len": self.tgt_len,
            "epoch": self._epoch,
            "step": self._step,
            "position": self._position,
            "layout_spans": [[start, end] for start, end in self._layout.spans],
            "tokens_consumed": self.num_tokens - self._layout.total + self.num_streams * self._position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> ResumeKind:
        """Continue from ``state``: exactly with the same number of streams, re-partitioned with another.

        Refuses (`StreamStateError`) a state of another split, tokenizer, shard set, seed or shuffle setting.
        Iterators made before this call stop with an error; iterate anew.
        """
        self._check_state(state)
        old = StreamSpans([(int(a), int(b)) for a, b in state["layout_spans"]], state["num_streams"])
        position = state["position"]
        if position > old.tokens_per_stream:
            raise StreamStateError(
                f"stream state: position {position} lies beyond the streams' {old.tokens_per_stream} tokens"
            )
        self._generation += 1
        self._epoch, self._step = state["epoch"], state["step"]
        self._order = BlockOrder.for_epoch(
            self._store.block_tokens, shuffle=self.shuffle_blocks, seed=self.seed, epoch=self._epoch
        )
        if old.num_streams == self.num_streams:
            self._layout, self._position = old, position
            if state["tgt_len"] != self.tgt_len:
                logger.info(
                    "resume: tgt_len %d -> %d; the streams continue at token %d",
                    state["tgt_len"],
                    self.tgt_len,
                    position,
                )
            self._settle()
            return ResumeKind.EXACT
        self._layout = StreamSpans(old.unconsumed_spans(position), self.num_streams)
        self._position = 0
        logger.warning(
            "resume with %d streams instead of %d: epoch %d re-partitioned; %d tokens consumed, the %d left are cut "
            "into %d streams of %d tokens (%d steps of %d); mems reset",
            self.num_streams,
            old.num_streams,
            self._epoch,
            self.num_tokens - self._layout.total,
            self._layout.total,
            self.num_streams,
            self._layout.tokens_per_stream,
            self._layout.windows_left(0, self.tgt_len),
            self.tgt_len,
        )
        self._settle()
        return ResumeKind.REPARTITIONED

    def _check_state(self, state: dict[str, Any]) -> None:
        loader = {
            "split": self.split,
            "tokenizer_fingerprint": self.manifest.tokenizer.fingerprint,
            "manifest_id": self.manifest_id,
            "shuffle_blocks": self.shuffle_blocks,
            "seed": self.seed,
        }
        check_state(state, loader, self.num_tokens, self._store.manifest_path)

    def close(self) -> None:
        """Release open remote shard streams."""
        for rows in self._slots:
            rows.close()

    def __enter__(self) -> TrainStreams:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
