"""What a run carries from one step to the next besides DeepSpeed's engine, saved as one and restored as one:
the step, the tokens seen, the best validation result, the data position, the memory of every stream and the
random-number generators: what a save writes (`client_state`, `rank_state`, and the `record` its COMPLETE.json
holds; `CheckpointManager.save`) and what `TrainState.load` restores.

A checkpoint holds it in two parts (`txl_dist.checkpoint_paths`): the client state under `CLIENT_KEY`, the
same on every rank, beside the run's record that export and convert read back (the resolved config, the
architecture, the tokenizer, the world size and the batch split); and one `RankState` file per rank, with the
memory of each stream the rank owns, by stream id, and the rank's RNG states. How a saved state maps onto another
number of ranks or streams: docs/architecture.md (Streams).

The Transformer-XL memory of each micro-batch slot: carried from step to step, kept finite, saved by stream id.

Micro-batch slot k of a rank always holds the same global streams, and its rows continue exactly where the
previous step's rows ended, so the memory of slot k (n_layer + 1 tensors [mem_len, micro_batch, d_model]) always
belongs to the text that follows. A stream whose new memory holds inf/nan (an fp16 forward that overflowed) gets a
zero memory instead, counted in the logged ``mems_reset``, so no later segment carries it and no checkpoint
stores it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from txl_dist.checkpoint_paths import CLIENT_KEY, tag_for_step
from txl_dist.checkpoints.manager import CheckpointManager
from txl_dist.checkpoints.rank_state import RankState, dropout_seed, rng_state, set_rng_state
from txl_dist.checkpoints.record import CheckpointRecord
from txl_dist.checkpoints.universal import ResumePlan
from txl_dist.data import ResumeKind, TrainStreams
from txl_dist.rendezvous.ranks import Place
from txl_dist.supervision.guard import RunGuard
from txl_dist.training.numerics import NumericsState
from txl_dist.training.resolved import ResolvedRun
from txl_dist.training.schedule import set_peak


def finite_mems(mems: list[torch.Tensor], resets: torch.Tensor) -> list[torch.Tensor]:
    """``mems`` (n_layer + 1 tensors [mem_len, B, d_model]) with the columns (streams) that hold inf or nan in any
    layer set to zero -- the memory HuggingFace's Transformer-XL starts from -- and their number added to
    ``resets``; all on the device, without a host synchronisation."""
    finite = torch.stack([m.isfinite().all(dim=2).all(dim=0) for m in mems]).all(dim=0)  # [B]
    resets += (~finite).sum()
    keep = finite.view(1, -1, 1)
    return [torch.where(keep, m, torch.zeros((), dtype=m.dtype, device=m.device)) for m in mems]


class SlotMemories:
    """The memory of each of a rank's ``slots`` micro-batch slots (None: empty), on ``device``."""

    def __init__(self, slots: int, device: torch.device):
        self._mems: list[list[torch.Tensor] | None] = [None] * slots
        self._resets = torch.zeros((), dtype=torch.int64, device=device)
        self._device = device

    def __getitem__(self, slot: int) -> list[torch.Tensor] | None:
        return self._mems[slot]

    def clear(self, slot: int) -> None:
        self._mems[slot] = None

    def update(self, slot: int, mems: list[torch.Tensor]) -> None:
        """The memory a forward returned for ``slot``, with its non-finite streams reset."""
        self._mems[slot] = finite_mems(mems, self._resets)

    def for_checkpoint(self) -> list[torch.Tensor] | None:
        """Every slot's memory, columns in slot order, finite, on the CPU; None while any slot has none."""
        if any(m is None for m in self._mems):
            return None
        layers = [torch.cat([slot[layer] for slot in self._mems], dim=1) for layer in range(len(self._mems[0]))]
        return [layer.cpu() for layer in finite_mems(layers, self._resets)]

    def restore(self, mems_by_stream: dict[int, list[torch.Tensor]], slot_streams: list[list[int]]) -> None:
        """Each slot's memory from a checkpoint's memories by stream id (``slot_streams``: the stream ids of each
        slot); a slot missing any of its streams stays empty."""
        for slot, ids in enumerate(slot_streams):
            if all(i in mems_by_stream for i in ids):
                layers = zip(*(mems_by_stream[i] for i in ids))
                self._mems[slot] = [torch.stack(columns, dim=1).to(self._device) for columns in layers]

    def reset_total(self) -> int:
        """Collective: streams whose memory was reset since this process started, over all ranks."""
        total = self._resets.clone()
        dist.all_reduce(total)
        return int(total.item())


log = logging.getLogger("txl_dist.training")


@dataclass
class TrainState:
    """The resumable state of rank ``rank`` of ``world_size``.

    ``run_record``: what is fixed for the run and written with every checkpoint for the tools that read one (config,
    architecture, tokenizer, batch split; `txl_dist.convert.zero`); the trainer never reads them back."""

    streams: TrainStreams
    memories: SlotMemories
    seed: int
    rank: int
    world_size: int
    run_record: dict[str, Any]
    numerics: NumericsState
    """The spike detector's window and the data windows skipped (`txl_dist.training.numerics`)."""
    peak_lr: float
    """optim.lr: the schedule's peak, times ``numerics.lr_factor``, whatever peak a loaded checkpoint held."""
    step: int = 0
    tokens_seen: int = 0
    best: dict[str, Any] | None = None
    """The best full validation pass so far: step, loss, ppl, targets."""
    _said: set[tuple[float, float]] = field(default_factory=set, repr=False)
    """The changes of the peak already logged (a rollback loads the same checkpoint again)."""

    def client_state(self) -> dict[str, Any]:
        """DeepSpeed's client state of a checkpoint: the same on every rank."""
        return {
            CLIENT_KEY: {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "data": self.streams.state_dict(),
                **self.run_record,
                "best": self.best,
                "world_size": self.world_size,
                "numerics": self.numerics.state_dict(),
            }
        }

    def rank_state(self) -> RankState:
        """This rank's own part: its streams' memories, columns in `TrainStreams.rank_stream_ids` order, and RNG."""
        return RankState(
            stream_ids=self.streams.rank_stream_ids(),
            mems=self.memories.for_checkpoint(),
            rng=rng_state(),
            world_size=self.world_size,
            rank=self.rank,
        )

    def record(self, zero_stage: int, health: dict[str, Any] | None) -> CheckpointRecord:
        """What a checkpoint or snapshot of the current step records of it (`CheckpointRecord`), for ``health``:
        the step's loss and gradient norm as the ranks agreed on them."""
        return CheckpointRecord(
            step=self.step,
            world_size=self.world_size,
            streams_per_rank=len(self.streams.rank_stream_ids()),
            architecture=self.run_record["architecture"],
            zero_stage=zero_stage,
            health=health,
        )

    def best_tag(self) -> str | None:
        """The checkpoint of the best validation pass so far, which rotation keeps."""
        return tag_for_step(self.best["step"]) if self.best else None

    def follow_schedule(self, engine, when: str) -> None:
        """The learning-rate curve of this run's optim.lr, times the factor its skipped windows left (a loaded
        checkpoint's scheduler holds the peak it was saved with); a changed peak is said once."""
        peak = self.peak_lr * self.numerics.lr_factor
        before = set_peak(engine.lr_scheduler, peak)
        if self.rank == 0 and not math.isclose(before, peak, rel_tol=1e-12) and (before, peak) not in self._said:
            self._said.add((before, peak))
            log.info("the learning rate's peak is %.4g from step %d (it was %.4g %s)", peak, self.step, before, when)

    def load(self, checkpoints: CheckpointManager, engine, plan: ResumePlan) -> ResumeKind:
        """Collective: ``engine`` and this state from the checkpoint ``plan`` names (`CheckpointManager.
        plan_resume`), at the start of a run or at a rollback. The memories and the RNG states continue exactly
        where the streams map onto these ranks one to one; otherwise the memories start empty and dropout is
        reseeded from (seed, step, rank)."""
        client_state = checkpoints.load(engine, plan)
        if client_state is None or CLIENT_KEY not in client_state:
            raise RuntimeError(f"{checkpoints.directory / plan.tag}: not a txl_dist checkpoint (no client state)")
        saved = client_state[CLIENT_KEY]
        self.step, self.tokens_seen, self.best = saved["step"], saved["tokens_seen"], saved.get("best")
        self.numerics.load_state_dict(saved.get("numerics"), str(checkpoints.directory / plan.tag))
        self.follow_schedule(engine, f"when {checkpoints.directory / plan.tag} was saved")
        kind = self.streams.load_state_dict(saved["data"])
        rng = None
        if kind == ResumeKind.EXACT:
            mems_by_stream, rng = checkpoints.load_rank_states(plan.tag, self.streams.rank_stream_ids())
            self.memories.restore(mems_by_stream, self.streams.slot_stream_ids())
        else:
            log.warning("rank %d: the number of streams changed; memory starts empty", self.rank)
        if rng is not None:
            set_rng_state(rng)
        else:
            torch.manual_seed(dropout_seed(self.seed, self.rank, self.step))
            if self.rank == 0:
                log.info(
                    "the checkpoint's ranks (%d) and streams do not map onto these %d ranks one to one: "
                    "dropout RNG reseeded from (seed, step, rank)",
                    saved["world_size"],
                    self.world_size,
                )
        return kind


def resumed_state(
    run: ResolvedRun,
    place: Place,
    guard: RunGuard,
    checkpoints: CheckpointManager,
    engine: Any,
    streams: TrainStreams,
    resume_plan: ResumePlan | None,
) -> TrainState:
    """Collective (`txl_dist.training.startup`'s step 8): the run's `TrainState` over ``streams``, loaded into it
    and ``engine`` from the checkpoint ``resume_plan`` chose (fresh without one)."""
    cfg = run.cfg
    state = TrainState(
        streams,
        SlotMemories(run.batch_split.grad_accum, place.device),
        seed=cfg.train.seed,
        rank=place.rank,
        world_size=place.world_size,
        run_record={
            "config": cfg.to_dict(),
            "architecture": cfg.model.architecture(),
            "tokenizer": dataclasses.asdict(run.manifest.tokenizer),
            "batch_split": run.batch_split._asdict(),
        },
        numerics=NumericsState(cfg.numerics),
        peak_lr=cfg.optim.lr,
    )
    if resume_plan is None:
        return state
    kind = state.load(checkpoints, engine, resume_plan)
    guard.progress(state.step)
    guard.checkpointed(state.step)
    if place.rank == 0:
        log.info(
            "resumed from %s at step %d (%s, %d tokens seen)",
            checkpoints.directory / resume_plan.tag,
            state.step,
            kind.value,
            state.tokens_seen,
        )
    return state
