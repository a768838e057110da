"""What a run carries from one step to the next besides DeepSpeed's engine, saved as one and restored as one:
the step, the tokens seen, the best validation result, the data position, the memory of every stream and the
random-number generators (`TrainState.save`, `TrainState.load`).

A checkpoint holds it in two parts (`txl_dist.checkpoints.layout`): the client state under `CLIENT_KEY`, the
same on every rank, beside the run's facts that export and convert read back (the resolved config, the
architecture, the tokenizer, the world size and the batch layout); and one `RankState` file per rank, with the
memory of each stream the rank owns, by stream id, and the rank's RNG states. How a saved state maps onto another
number of ranks or streams: docs/architecture.md (Streams).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from txl_dist.checkpoints.layout import CLIENT_KEY, tag_for_step
from txl_dist.checkpoints.manager import CheckpointManager
from txl_dist.checkpoints.rank_state import RankState, dropout_seed, rng_state, set_rng_state
from txl_dist.checkpoints.universal import ResumePlan
from txl_dist.data import ResumeKind, TrainStreams
from txl_dist.training.stream_memory import SlotMemories

log = logging.getLogger("txl_dist.training")


@dataclass
class TrainState:
    """The resumable state of rank ``rank`` of ``world_size``.

    ``facts``: what is fixed for the run and written with every checkpoint for the tools that read one (config,
    architecture, tokenizer, layout; `txl_dist.convert.zero`); the trainer never reads them back."""

    streams: TrainStreams
    memories: SlotMemories
    seed: int
    rank: int
    world_size: int
    facts: dict[str, Any]
    step: int = 0
    tokens_seen: int = 0
    best: dict[str, Any] | None = None
    """The best full validation pass so far: step, loss, ppl, targets."""

    def client_state(self) -> dict[str, Any]:
        """DeepSpeed's client state of a checkpoint: the same on every rank."""
        return {
            CLIENT_KEY: {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "data": self.streams.state_dict(),
                **self.facts,
                "best": self.best,
                "world_size": self.world_size,
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

    def save(self, checkpoints: CheckpointManager, engine, background: bool = False) -> str:
        """Collective: a checkpoint of ``engine`` and this state at the current step (written in the background:
        `CheckpointManager.save`); returns its tag."""
        return checkpoints.save(
            engine,
            self.step,
            self.client_state(),
            self.rank_state(),
            architecture=self.facts["architecture"],
            best_tag=tag_for_step(self.best["step"]) if self.best else None,
            background=background,
        )

    def load(self, checkpoints: CheckpointManager, engine, plan: ResumePlan) -> ResumeKind:
        """Collective: ``engine`` and this state from the checkpoint ``plan`` names (`CheckpointManager.
        plan_resume`). The memories and the RNG states continue exactly where the streams map onto these ranks one
        to one; otherwise the memories start empty and dropout is reseeded from (seed, step, rank)."""
        client_state = checkpoints.load(engine, plan)
        if client_state is None or CLIENT_KEY not in client_state:
            raise RuntimeError(f"{checkpoints.directory / plan.tag}: not a txl_dist checkpoint (no client state)")
        saved = client_state[CLIENT_KEY]
        self.step, self.tokens_seen, self.best = saved["step"], saved["tokens_seen"], saved.get("best")
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
        if self.rank == 0:
            log.info(
                "resumed from %s at step %d (%s, %d tokens seen)",
                checkpoints.directory / plan.tag,
                self.step,
                kind.value,
                self.tokens_seen,
            )
        return kind
