"""When the training loop logs, evaluates, saves and stops: pure functions of the step, no process group needed.

A step is followed, in this order, by its log line (every ``log.every`` steps and at the last step), an
evaluation (every ``eval.every`` steps, not at the last step), the ranks' agreement on a stop request, then a save
(every ``checkpoint.every`` steps, once ``checkpoint.every_minutes`` have passed since the last save, at a new best
evaluation, and on a stop request). The clock is read by rank 0 alone and its verdict travels with the stop
request's agreement, so that every rank saves at the same step. A run that ends by its
cadence (max_steps, max_epochs) rather than by a stop request ends with a full evaluation and a save of the last
step when that step is not saved yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from txl_dist.config import RunConfig


@dataclass(frozen=True)
class Cadence:
    max_steps: int
    max_epochs: int | None
    log_every: int
    eval_every: int
    """0: only the full evaluation at the end."""
    checkpoint_every: int
    """0: only at a new best evaluation, on a stop request and at the end."""
    checkpoint_every_seconds: float = 0.0
    """Wall-clock seconds between saves (checkpoint.every_minutes x 60); 0: no clock cadence."""
    memory_every: int = 0
    """Steps between memory snapshots (checkpoint.memory_every); 0: none."""

    @classmethod
    def of(cls, cfg: RunConfig) -> Cadence:
        return cls(
            max_steps=cfg.train.max_steps,
            max_epochs=cfg.train.max_epochs,
            log_every=cfg.log.every,
            eval_every=cfg.eval.every,
            checkpoint_every=cfg.checkpoint.every,
            checkpoint_every_seconds=60.0 * (cfg.checkpoint.every_minutes or 0),
            memory_every=cfg.checkpoint.memory_every,
        )

    def stop_before(self, step: int, epoch: int) -> str | None:
        """Why the run ends before training step ``step + 1`` (at the start of ``epoch``), None while it goes on.
        Asked before the step's first micro-batch is taken, so that the saved data position is exact."""
        if step >= self.max_steps:
            return f"max_steps={self.max_steps}"
        if self.max_epochs is not None and epoch >= self.max_epochs:
            return f"max_epochs={self.max_epochs}"
        return None

    def log_after(self, step: int) -> bool:
        return step % self.log_every == 0 or step >= self.max_steps

    def evaluate_after(self, step: int) -> bool:
        """A sampled evaluation during training; the last step gets the full one at the end instead."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.max_steps

    def clock_save_due(self, now: float, last_save: float) -> bool:
        """Whether ``checkpoint_every_seconds`` have passed between ``last_save`` and ``now`` (seconds of one
        monotonic clock: the end of the last save, or the start of training)."""
        return bool(self.checkpoint_every_seconds) and now - last_save >= self.checkpoint_every_seconds

    def snapshot_after(self, step: int) -> bool:
        """A memory snapshot after ``step`` (when no checkpoint is saved there: a checkpoint is newer)."""
        return bool(self.memory_every) and step % self.memory_every == 0 and step < self.max_steps

    def save_after(self, step: int, *, stopping: bool, new_best: bool, clock_due: bool = False) -> bool:
        """``stopping``: the ranks agreed on a stop request; ``new_best``: this step's evaluation is the best;
        ``clock_due``: rank 0's `clock_save_due`, as every rank received it."""
        periodic = bool(self.checkpoint_every) and step % self.checkpoint_every == 0
        return stopping or new_best or ((periodic or clock_due) and step < self.max_steps)
