"""What a checkpoint says of the state it holds: `CheckpointRecord`, one type for the facts that its COMPLETE.json
records (and a memory snapshot's manifest, which becomes that COMPLETE.json when the snapshot is written back).

A resuming run reads them before it builds anything: the step, the ranks that saved it and the streams each
owned (whether the memories continue exactly), the model's architecture (refused when it differs), the ZeRO stage
(how the files load), and the health of the step (its loss and gradient norm as the ranks agreed on them: a sick
one is never resumed, `txl_dist.checkpoints.verify.health_problem`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """The facts of one saved state, as every rank agrees on them."""

    step: int
    world_size: int
    """The ranks that saved it."""
    streams_per_rank: int
    """Rank r owned streams [r * n, (r + 1) * n): a resuming rank opens only the files of its streams."""
    architecture: dict[str, Any]
    zero_stage: int
    health: dict[str, Any] | None = None
    """The step's loss and gradient norm (`txl_dist.training.numerics.StepHealth.record`); None where the engine
    skipped the step's update or the check is off."""

    def fields(self) -> dict[str, Any]:
        """The record as COMPLETE.json and a snapshot's manifest hold it (``health`` only when known)."""
        fields = {
            "step": self.step,
            "world_size": self.world_size,
            "streams_per_rank": self.streams_per_rank,
            "architecture": self.architecture,
            "zero_stage": self.zero_stage,
        }
        return {**fields, "health": self.health} if self.health is not None else fields

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> CheckpointRecord:
        """The record of a manifest or marker that holds `fields` (checked by its reader already)."""
        return cls(
            step=fields["step"],
            world_size=fields["world_size"],
            streams_per_rank=fields["streams_per_rank"],
            architecture=fields["architecture"],
            zero_stage=fields["zero_stage"],
            health=fields.get("health"),
        )
