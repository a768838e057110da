"""Per-rank contiguous token streams: the batches that keep every rank's memory coherent.

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

Evaluation (`EvalStreams`): the split (never shuffled) is cut into world_size x batch_size streams that share
their boundary tokens, so that every target (every token but the first) is scored exactly once across ranks;
the last windows are padded and masked, and every rank runs the same number of steps.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from txl_dist.data.format import Manifest, ManifestError, read_manifest
from txl_dist.data.reader import BlockOrder, ShardStore, StreamReader

logger = logging.getLogger("txl_dist.data")

STATE_FORMAT = "txl_dist.streams"
STATE_VERSION = 1
# Windows are cut from per-row buffers of about this many tokens: refilling a row costs a few microseconds of
# Python, which this spreads to well under a nanosecond per token.
_BUFFER_TOKENS = 16384


class StreamStateError(ValueError):
    """A stream state that does not belong to this split, tokenizer, shard set or seed; the message says which."""


class ResumeKind(str, enum.Enum):
    """What `TrainStreams.load_state_dict` did, which tells the trainer what to do with the saved mems."""

    EXACT = "exact"
    """Same number of streams: every stream continues where it stopped; restore the mems by stream id."""
    REPARTITIONED = "repartitioned"
    """Another number of streams: the rest of the epoch was re-cut; the mems must start empty."""


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


@dataclasses.dataclass
class _Layout:
    """The token sequence an epoch's streams are cut from: spans of the epoch order, concatenated.

    A fresh epoch is one span, the whole split; after a re-partition it is the unconsumed spans of the old streams.
    """

    spans: list[tuple[int, int]]
    num_streams: int

    def __post_init__(self) -> None:
        lengths = np.array([end - start for start, end in self.spans], dtype=np.int64)
        self._span_starts = np.zeros(len(self.spans) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._span_starts[1:])
        self.total = int(self._span_starts[-1])
        self.tokens_per_stream = self.total // self.num_streams

    def windows_left(self, position: int, tgt_len: int) -> int:
        """Windows of tgt_len + 1 tokens that still fit in every stream from ``position`` on."""
        return max(0, (self.tokens_per_stream - 1 - position) // tgt_len)

    def stream_start(self, stream: int) -> int:
        return stream * self.tokens_per_stream

    def epoch_ranges(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """The positions of the epoch order that positions [start, stop) of this layout are, as ranges."""
        index = int(np.searchsorted(self._span_starts, start, side="right")) - 1
        while start < stop:
            span_start, span_end = self.spans[index]
            offset = start - int(self._span_starts[index])
            take = min(stop - start, span_end - span_start - offset)
            if take > 0:
                yield span_start + offset, span_start + offset + take
                start += take
            index += 1

    def unconsumed_spans(self, position: int) -> list[tuple[int, int]]:
        """Epoch-order spans not yet used as inputs when every stream stands at ``position``: each stream's rest
        and the tail after the last stream, merged where they touch."""
        pieces = [(self.stream_start(s) + position, self.stream_start(s + 1)) for s in range(self.num_streams)] + [
            (self.num_streams * self.tokens_per_stream, self.total)
        ]
        spans: list[tuple[int, int]] = []
        for start, stop in pieces:
            for begin, end in self.epoch_ranges(start, stop):
                if spans and spans[-1][1] == begin:
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((begin, end))
        return spans


def _open_split(shards: str | os.PathLike, split: str, expected_fingerprint: str | None) -> Manifest:
    manifest = read_manifest(shards)
    where = os.path.join(os.fspath(shards), "manifest.json")
    if split not in manifest.splits:
        raise ManifestError(f"{where}: no split '{split}'; it has {sorted(manifest.splits)}")
    if expected_fingerprint is not None and expected_fingerprint != manifest.tokenizer.fingerprint:
        raise ManifestError(
            f"{where}: tokenizer fingerprint {manifest.tokenizer.fingerprint} differs from the configured "
            f"tokenizer's {expected_fingerprint}: these shards were built with another tokenizer"
        )
    return manifest


def _manifest_identity(manifest: Manifest, split: str) -> str:
    """sha256 of what a stream position refers to: the tokenizer and the split's shard contents, not their paths
    (shards moved to object storage keep their identity)."""
    shards = [[shard.sha256, shard.tokens, shard.blocks] for shard in manifest.splits[split].shards]
    text = json.dumps([manifest.tokenizer.fingerprint, shards], separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _rank_in_world(rank: int, world_size: int) -> None:
    _positive(world_size=world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank!r}")


class _Rows:
    """The streams of one micro-batch slot: a [rows, buffer] token buffer refilled from their readers."""

    def __init__(self, store: ShardStore, stream_ids: list[int], buffer_tokens: int, pad_id: int):
        self.stream_ids = stream_ids
        self.stream_ids_tensor = torch.tensor(stream_ids, dtype=torch.int64)
        self.readers = [StreamReader(store) for _ in stream_ids]
        self.buffer = np.empty((len(stream_ids), buffer_tokens), dtype=store.dtype)
        self.pad_id = pad_id

    def fill(self, layout: _Layout, order: BlockOrder, starts: list[int], counts: list[int]) -> None:
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
    ):
        _positive(tgt_len=tgt_len, micro_batch=micro_batch, grad_accum=grad_accum)
        _rank_in_world(rank, world_size)
        self.manifest = _open_split(shards, split, expected_fingerprint)
        self.split = split
        self.tgt_len = tgt_len
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle_blocks = shuffle_blocks
        self.manifest_id = _manifest_identity(self.manifest, split)
        self._store = ShardStore(shards, self.manifest, split, verify_sha256=verify_sha256)
        self.num_streams = world_size * micro_batch * grad_accum
        self.num_tokens = self.manifest.splits[split].tokens
        fresh = _Layout([(0, self.num_tokens)], self.num_streams)
        if fresh.windows_left(0, tgt_len) == 0:
            raise ValueError(
                f"split '{split}' of {self._store.manifest_path} has {self.num_tokens} tokens: too few for "
                f"{self.num_streams} streams (world_size {world_size} x micro_batch {micro_batch} x grad_accum "
                f"{grad_accum}) of at least tgt_len + 1 = {tgt_len + 1} tokens"
            )
        self.tokens_per_stream = fresh.tokens_per_stream
        self.steps_per_epoch = fresh.windows_left(0, tgt_len)
        self.dropped_tail_tokens = self.num_tokens - self.num_streams * self.steps_per_epoch * tgt_len
        logger.info(
            "split '%s': %d tokens in %d streams of %d tokens, %d steps of %d tokens per epoch; %d tokens (%.3f%%) "
            "not trained on per epoch (%d after the last stream, %d at the end of each stream)",
            split,
            self.num_tokens,
            self.num_streams,
            self.tokens_per_stream,
            self.steps_per_epoch,
            tgt_len,
            self.dropped_tail_tokens,
            100.0 * self.dropped_tail_tokens / self.num_tokens,
            self.num_tokens - self.num_streams * self.tokens_per_stream,
            self.tokens_per_stream - self.steps_per_epoch * tgt_len,
        )
        buffer_tokens = max(1, _BUFFER_TOKENS // tgt_len) * tgt_len + 1
        first_id = rank * micro_batch * grad_accum
        self._slots = [
            _Rows(
                self._store,
                list(range(first_id + k * micro_batch, first_id + (k + 1) * micro_batch)),
                buffer_tokens,
                self.manifest.tokenizer.eod_id,
            )
            for k in range(grad_accum)
        ]
        self._generation = 0
        self._start_epoch(0)

    def stream_ids(self, slot: int) -> list[int]:
        """The global stream ids of this rank's micro-batch ``slot``, in row order."""
        return list(self._slots[slot].stream_ids)

    @property
    def epoch(self) -> int:
        """The epoch of the next step (it moves on as the last micro-batch of an epoch is handed out)."""
        return self._epoch

    def _start_epoch(self, epoch: int) -> None:
        self._epoch, self._step, self._position = epoch, 0, 0
        self._layout = _Layout([(0, self.num_tokens)], self.num_streams)
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
        old = _Layout([(int(a), int(b)) for a, b in state["layout_spans"]], state["num_streams"])
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
        self._layout = _Layout(old.unconsumed_spans(position), self.num_streams)
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
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise StreamStateError(f"not a stream state: key 'format' must be {STATE_FORMAT!r}")
        if state.get("version") != STATE_VERSION:
            raise StreamStateError(f"stream state: version {state.get('version')!r}, this reader reads {STATE_VERSION}")
        for key in ("num_streams", "tgt_len"):
            if not isinstance(state.get(key), int) or state[key] <= 0:
                raise StreamStateError(f"stream state: key '{key}' must be a positive integer, got {state.get(key)!r}")
        for key in ("epoch", "step", "position", "seed"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise StreamStateError(
                    f"stream state: key '{key}' must be a non-negative integer, got {state.get(key)!r}"
                )
        where = self._store.manifest_path
        mismatches = [
            ("split", state.get("split"), self.split, "the state belongs to another split"),
            (
                "tokenizer_fingerprint",
                state.get("tokenizer_fingerprint"),
                self.manifest.tokenizer.fingerprint,
                f"the state was saved with another tokenizer than the one of {where}",
            ),
            (
                "manifest_id",
                state.get("manifest_id"),
                self.manifest_id,
                f"the state was saved on other shards than those of {where} (rebuilt or changed)",
            ),
            (
                "shuffle_blocks",
                state.get("shuffle_blocks"),
                self.shuffle_blocks,
                "the epoch's block order would differ",
            ),
        ]
        if self.shuffle_blocks:  # the seed orders the blocks only when they are shuffled
            mismatches.append(("seed", state.get("seed"), self.seed, "the epoch's block order would differ"))
        for key, saved, current, why in mismatches:
            if saved != current:
                raise StreamStateError(f"stream state: key '{key}' is {saved!r}, this loader has {current!r}: {why}")
        spans = state.get("layout_spans")
        previous_end = 0
        if not isinstance(spans, list) or not spans:
            raise StreamStateError("stream state: key 'layout_spans' must be a non-empty list of [start, end]")
        for span in spans:
            if (
                not isinstance(span, (list, tuple))
                or len(span) != 2
                or not all(isinstance(v, int) for v in span)
                or not previous_end <= span[0] < span[1] <= self.num_tokens
            ):
                raise StreamStateError(
                    f"stream state: key 'layout_spans' has {span!r}; spans must increase within [0, {self.num_tokens}]"
                )
            previous_end = span[1]

    def close(self) -> None:
        """Release open remote shard streams."""
        for rows in self._slots:
            rows.close()

    def __enter__(self) -> TrainStreams:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


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
    ):
        _positive(tgt_len=tgt_len, batch_size=batch_size)
        _rank_in_world(rank, world_size)
        self.manifest = _open_split(shards, split, expected_fingerprint)
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
        buffer_tokens = max(1, _BUFFER_TOKENS // tgt_len) * tgt_len + 1
        self._rows = _Rows(self._store, ids, buffer_tokens, self.manifest.tokenizer.eod_id)
        self._layout = _Layout([(0, self.num_tokens)], 1)
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
