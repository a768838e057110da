"""The numerics guard of a training run, carried out: the verdict on each step, the rollback in the same process,
the replay and the skipped data windows, and what the user sees of them. What is decided, and why, is
`txl_dist.training.numerics`; this module does it with the run's parts (docs/recovery.md, Numerical faults).

A rollback restores the newest healthy state through the path a start takes: a memory snapshot newer than the
newest checkpoint is written back as one (`txl_dist.checkpoints.snapshots`), `CheckpointManager.plan_resume`
chooses the newest checkpoint that verifies and is not sick, and `TrainState.load` loads it into the live engine
(weights, optimizer, schedule, step, data position, memories, RNG, the detector's window). Every rank does the same
at the same step, since every rank reached the same verdict.

Each fault, rollback, verdict and skip is one console line (rank 0) and a ``numerics`` record in ``metrics.jsonl``
and TensorBoard (``numerics/*``), which ``python -m txl_dist.plot`` marks on the curves.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from txl_dist.checkpoint_paths import tag_for_step
from txl_dist.checkpoints.manager import CheckpointManager
from txl_dist.checkpoints.snapshots import Snapshots
from txl_dist.config import RunConfig
from txl_dist.data import TrainStreams
from txl_dist.supervision.guard import RunGuard
from txl_dist.training.numerics import (
    DataSkip,
    Fault,
    NumericalFailure,
    NumericsRecord,
    Recovery,
    StepHealth,
    Watch,
    data_key,
    json_number,
    number_text,
)
from txl_dist.training.run_log import RunLogger
from txl_dist.training.train_state import TrainState

log = logging.getLogger("txl_dist.training")


def gradient_norm(module: torch.nn.Module) -> torch.Tensor:
    """The 2-norm of every gradient of ``module`` together, on the device, without waiting for it: where the engine
    reports none (fp32 ZeRO-0 steps torch's optimizer, unwrapped)."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float64)


def step_numbers(step_loss: torch.Tensor, grad_norm: Any, rank: int) -> torch.Tensor:
    """This rank's part of the agreement that ends a step (summed over the ranks): its loss of the step, the
    gradient norm (the same on every rank; 0 where none is known), and whether its loss was not finite, alone and
    times its rank. On the loss's device, float64, queued without waiting; the agreement reads it on the host once
    the step's kernels are done (on a GPU, one synchronisation a step)."""
    bad = (~torch.isfinite(step_loss)).double()
    norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, dtype=torch.float64)
    return torch.stack([step_loss.double(), norm.to(step_loss.device), bad, bad * rank])


def agreed_health(
    numbers: list[float], world_size: int, norm_known: bool, overflow: bool, scale_pinned: bool
) -> StepHealth:
    """The `StepHealth` of the sums of every rank's `step_numbers`."""
    loss, grad_norm, bad_ranks, bad_rank_sum = numbers
    return StepHealth(
        loss=loss / world_size,
        grad_norm=grad_norm / world_size if norm_known else None,
        bad_ranks=round(bad_ranks),
        bad_rank_sum=round(bad_rank_sum),
        overflow=overflow,
        scale_pinned=scale_pinned,
    )


class NumericsGuard:
    """One rank's numerics guard over the parts the trainer built. A rollback first completes a background save
    still being written (`CheckpointManager.finish`), then chooses the newest healthy state."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        state: TrainState,
        engine: Any,
        checkpoints: CheckpointManager,
        snapshots: Snapshots | None,
        record: NumericsRecord,
        logger: RunLogger,
        guard: RunGuard,
    ):
        self.cfg, self.state, self.engine = cfg, state, engine
        self.checkpoints, self.snapshots, self.record = checkpoints, snapshots, record
        self.logger, self.guard = logger, guard
        self.rank = state.rank
        self.watch = Watch(cfg.numerics, state.numerics, fp16=cfg.precision.dtype == "fp16", n_token=cfg.model.n_token)
        self.resumed: tuple[str, int] | None = None
        """The checkpoint this start resumed from and its step (`started_from`)."""
        self.recovery = Recovery(cfg.numerics)
        state.numerics.add_skips(record.skips)
        checkpoints.kept |= set(record.kept)
        elsewhere = [skip for skip in record.skips if skip.data["num_streams"] != state.streams.num_streams]
        if elsewhere and self.rank == 0:
            log.warning(
                "%s records %d skipped data window(s) of a run cut into %d streams; this run has %d "
                "(train.global_batch): they do not apply, and a fault they kept away may be met again",
                record.path,
                len(elsewhere),
                elsewhere[0].data["num_streams"],
                state.streams.num_streams,
            )

    @property
    def streams(self) -> TrainStreams:
        return self.state.streams

    def judge(self, health: StepHealth, memoryless: bool) -> Fault | None:
        """The fault of the step just taken, None when it is healthy (`Watch.judge`)."""
        return self.watch.judge(self.state.step, health, memoryless)

    def started_from(self, tag: str | None) -> None:
        """This start resumed from checkpoint ``tag`` (None: a fresh start), at the current step."""
        self.resumed = (tag, self.state.step) if tag is not None else None

    def require_finite_after_resume(self, loss: float, step: int) -> None:
        """Step ``step``, the first after a start from a checkpoint, gave a ``loss`` that is not finite (with
        numerics.check off, or again on the replay): the checkpoint's weights or optimizer state are not finite,
        and no rollback cures them (they would otherwise train on with every step skipped, and save more such
        checkpoints): `NumericalFailure`."""
        if math.isfinite(loss) or self.resumed is None or step != self.resumed[1] + 1:
            return
        verified = "" if self.cfg.checkpoint.verify else " (its files were not verified: checkpoint.verify=false)"
        raise NumericalFailure(
            f"the training loss is {loss} at step {step}, the first step after resuming from "
            f"{self.checkpoints.directory / self.resumed[0]}: the checkpoint's weights or optimizer state are not "
            f"finite{verified}. Nothing was saved; move that checkpoint aside to resume from the one before",
            step,
        )

    # ---- a fault ------------------------------------------------------------------------------------------------

    def recover(self, fault: Fault) -> int:
        """Collective: after ``fault``, the newest healthy state restored, then replayed or its data window skipped
        (`Recovery.plan`); returns the step restored. `NumericalFailure` when the plan is to stop, or nothing
        healthy is left to restore."""
        began = time.perf_counter()
        norm = f" (gradient norm {number_text(fault.grad_norm)})" if fault.check == "loss" else ""
        self.logger.info("step %d: numerical fault: %s%s; nothing of this step is saved", fault.step, fault.text, norm)
        # Recorded once restored: the restore purges TensorBoard's records from the step after the restored one.
        values = {"check": fault.check, "reason": fault.text, "loss": json_number(fault.loss)}
        values["grad_norm"] = json_number(fault.grad_norm)
        try:
            restored, source = self._restore(fault)
        finally:
            self._event(fault.step, "fault", **values)
        self._keep(tag_for_step(restored))
        plan = self.recovery.plan(fault, restored)
        if plan.action == "skip" and self.resumed is not None and restored == self.resumed[1]:
            self.require_finite_after_resume(fault.loss, fault.step)  # the replay of the first step failed as well
        if plan.action == "stop":
            self._event(fault.step, "stop", restored_step=restored, why=plan.why)
            raise NumericalFailure(
                f"numerical fault at step {fault.step}: {fault.text}; {plan.why}; stopping: the newest healthy "
                f"checkpoint {self.checkpoints.directory / tag_for_step(restored)} is kept, and the same command "
                "resumes from it (with a lower optim.lr, or numerics settings that let the run pass)",
                fault.step,
            )
        seconds = time.perf_counter() - began
        where = f"{source} {self.checkpoints.directory / tag_for_step(restored)}"
        budget = f"rollback {self.recovery.rollbacks} of numerics.max_rollbacks={self.cfg.numerics.max_rollbacks}"
        window = f"steps {restored + 1}-{fault.step}" if fault.step > restored + 1 else f"step {fault.step}"
        if plan.action == "replay":
            self.logger.info(
                "step %d: rolled back to step %d (%s) in %.2f s; replaying %s to tell a transient fault from one in "
                "the data (%s)",
                fault.step,
                restored,
                where,
                seconds,
                window,
                budget,
            )
        else:
            skip = self._skip_window(restored, fault.step)
            seconds = time.perf_counter() - began
            self.logger.info(
                "step %d failed again after the replay from step %d: the fault is in the data or the numerics; rolled "
                "back to step %d (%s) in %.2f s and skipped the data of %s (%d steps, %d tokens)%s (%s)",
                fault.step,
                restored,
                restored,
                where,
                seconds,
                window,
                skip.steps,
                skip.tokens,
                f"; learning rate x{skip.lr_factor:g}" if skip.lr_factor != 1 else "",
                budget,
            )
        self._event(
            fault.step,
            "rollback",
            restored_step=restored,
            failed_step=fault.step,
            plan=plan.action,
            attempt=plan.attempt,
            source=source,
            seconds=round(seconds, 3),
        )
        return restored

    def _restore(self, fault: Fault) -> tuple[int, str]:
        """Collective: the newest healthy state loaded; its step and where it came from."""
        self.checkpoints.finish()
        from_memory = None
        if self.snapshots is not None:
            self.snapshots.wait_for_copy()
            from_memory = self.snapshots.restore_into(self.checkpoints, self.cfg.checkpoint.verify)
        plan = self.checkpoints.plan_resume(
            resume=True,
            verify=self.cfg.checkpoint.verify,
            architecture=self.cfg.model.architecture(),
            zero_stage=self.cfg.zero.stage,
        )
        if plan is None:
            raise NumericalFailure(
                f"numerical fault at step {fault.step}: {fault.text}; no checkpoint or memory snapshot to roll back "
                f"to in {self.checkpoints.directory} yet (checkpoint.every={self.cfg.checkpoint.every}, "
                f"checkpoint.memory_every={self.cfg.checkpoint.memory_every}): stopping; nothing was saved",
                fault.step,
            )
        self.state.load(self.checkpoints, self.engine, plan)
        step = self.state.step
        self.guard.progress(step)
        self.guard.checkpointed(step)
        self.guard.snapshotted(None)
        self.logger.rolled_back(step)
        return step, "memory snapshot" if from_memory == step else "checkpoint"

    def _keep(self, tag: str) -> None:
        """Rotation keeps ``tag``, the healthy state before a fault, from now on (recorded for later starts)."""
        if tag in self.checkpoints.kept:
            return
        self.checkpoints.kept.add(tag)
        self.record.kept.append(tag)
        self._write_record()

    # ---- data windows ------------------------------------------------------------------------------------------

    def _skip_window(self, restored: int, failed: int) -> DataSkip:
        """The data of steps ``restored`` + 1 to ``failed`` passed over, from where the streams stand once the
        skips already made from this state are applied again (and those on the way, as the steps met them)."""
        self.apply_due_skips()
        data = data_key(self.streams.state_dict())
        steps = failed - restored
        skip = DataSkip(
            at_step=restored,
            failed_step=failed,
            steps=steps,
            tokens=self._pass_over(steps),
            data=data,
            lr_factor=self.cfg.numerics.lr_factor_after_skip,
        )
        self.state.numerics.add_skips([skip])
        self._after_skip(skip)
        self._event(
            restored,
            "skip",
            from_step=restored + 1,
            to_step=failed,
            steps=skip.steps,
            tokens=skip.tokens,
            epoch=data["epoch"],
            position=data["position"],
            lr_factor=skip.lr_factor,
        )
        return skip

    def apply_due_skips(self) -> bool:
        """Before a step: pass over every recorded data window that starts where the streams stand (a resume or a
        rollback from before a skip); whether the streams moved (their iterator is then made anew)."""
        moved = False
        while self.state.numerics.skips and (skip := self.state.numerics.due(self.streams.state_dict())):
            self._pass_over(skip.steps)
            self._after_skip(skip)
            moved = True
            self.logger.info(
                "step %d: skipping the data window recorded after the fault at step %d (%d steps, %d tokens), as "
                "the run did before",
                self.state.step,
                skip.failed_step,
                skip.steps,
                skip.tokens,
            )
            self._event(self.state.step, "skip_applied", failed_step=skip.failed_step, tokens=skip.tokens)
        return moved

    def _pass_over(self, steps: int) -> int:
        """The streams moved on by ``steps`` steps, one at a time, each window recorded to start on the way passed
        over as well (as the steps that made this window met it); the tokens of these ``steps``."""
        tokens = 0
        for step in range(steps):
            tokens += self.streams.skip(1)
            if step + 1 < steps:  # a window starting where the last step ends is the caller's to apply
                self.apply_due_skips()
        return tokens

    def _after_skip(self, skip: DataSkip) -> None:
        """The text jumps: every slot's memory starts empty; and the learning rate scaled as the skip says."""
        for slot in range(self.state.streams.grad_accum):
            self.state.memories.clear(slot)
        if skip.lr_factor != 1:
            self.state.numerics.lr_factor *= skip.lr_factor
            self.state.follow_schedule(self.engine, f"before the data window of the fault at step {skip.failed_step}")

    # ---- verdicts -----------------------------------------------------------------------------------------------

    def after_healthy_step(self, health: StepHealth) -> None:
        """A healthy step: the verdict on a replayed fault once its failed step has passed, and every skipped
        window the run has now trained past recorded for later starts (whatever faults came between)."""
        step = self.state.step
        incident = self.recovery.passed(step)
        if incident is not None and incident.action == "replay":
            self.logger.info(
                "step %d passed on the replay from step %d (loss %s): the fault was transient (a machine's, not the "
                "data's); the run goes on as if it had not happened",
                step,
                incident.restored,
                number_text(health.loss),
            )
            self._event(step, "transient", restored_step=incident.restored, loss=json_number(health.loss))
        recorded = {skip.key() for skip in self.record.skips}
        passed = [skip for skip in self.state.numerics.skips if skip.failed_step <= step and skip.key() not in recorded]
        if not passed:
            return
        self.record.skips += passed
        self._write_record()
        for skip in passed:
            self.logger.info(
                "step %d passed after the skipped window (loss %s): the data of steps %d-%d is skipped for good, "
                "recorded in %s for every later resume",
                step,
                number_text(health.loss),
                skip.at_step + 1,
                skip.failed_step,
                self.record.path,
            )
            self._event(step, "skip_recorded", from_step=skip.at_step + 1, to_step=skip.failed_step, tokens=skip.tokens)

    # ---- reports ------------------------------------------------------------------------------------------------

    def _event(self, step: int, event: str, **values: Any) -> None:
        self.logger.record(step, "numerics", {"event": event, event: 1, **values})

    def _write_record(self) -> None:
        """Rank 0: numerics.json rewritten. A record that cannot be written costs only a later resume's memory of
        it (the checkpoints hold their skips too): a warning, and training goes on."""
        if self.rank != 0:
            return
        try:
            self.record.write()
        except OSError as error:
            log.warning("numerics: %s cannot be written (%s); training goes on", self.record.path, error)
