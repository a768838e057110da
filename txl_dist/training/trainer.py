"""The training loop: DeepSpeed ZeRO data parallelism with per-rank contiguous streams and coherent mems.

Every optimizer step runs grad_accum micro-batches per rank. Micro-batch slot k of a rank always holds the same
global streams (consecutive ids), and its rows continue exactly where the previous step's rows ended, so the
memory of slot k always belongs to the text that follows (`txl_dist.training.train_state`) -- the authors'
``batch_chunk``, made distributed. The memory is detached after every forward.

A checkpoint holds DeepSpeed's engine state and the `TrainState` (`txl_dist.training.train_state`: step, tokens
seen, data position, best validation result, and per rank the memory of each stream by stream id plus the RNG
states), saved as one and loaded as one. Rerunning the same command resumes from the newest complete checkpoint
that verifies; `CheckpointManager.plan_resume` decides which before the engine is built, and how it loads. With
the same number of streams (whatever the world size) streams and memory continue exactly; with another number the
data is re-partitioned and the memory starts empty (the log says so). Any ZeRO stage resumes any other's
checkpoint (`txl_dist.checkpoints.universal`).

SIGTERM or SIGINT (what Slurm sends before preemption) finishes the current step, writes a checkpoint and exits
with status 0; the ranks agree on the step through an all-reduce of the stop flag after every step. So does the
end of the process that started the job (see `txl_dist.supervision.guard`: no rank trains on as an orphan). When
the loop logs, evaluates and saves: `txl_dist.training.cadence`. The run owns its output directory
(`txl_dist.training.run_dir`). A non-finite loss on the first step after a resume stops the run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from txl_dist.checkpoints.manager import CheckpointManager, Save
from txl_dist.checkpoints.record import CheckpointRecord
from txl_dist.checkpoints.snapshots import Snapshots
from txl_dist.data import EvalStreams
from txl_dist.evaluation import EvalResult, evaluate, to_device
from txl_dist.model import TransformerXLLM
from txl_dist.model.recurrence import SegmentSettings
from txl_dist.rendezvous.ranks import Place
from txl_dist.supervision.guard import RunGuard
from txl_dist.tokenizer import CHARACTER_KINDS
from txl_dist.training.cadence import Cadence
from txl_dist.training.numerics import StepHealth
from txl_dist.training.numerics_guard import NumericsGuard, agreed_health, gradient_norm, step_numbers
from txl_dist.training.profiling import StepProfiler, out_of_memory_snapshot
from txl_dist.training.resolved import ResolvedRun
from txl_dist.training.run_dir import RunDirectory
from txl_dist.training.run_log import RunLogger
from txl_dist.training.step_log import StepLog, log_best, log_done, log_start, loss_scale
from txl_dist.training.throughput import FlopsMeter
from txl_dist.training.train_state import TrainState

log = logging.getLogger("txl_dist.training")


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What `txl_dist.training.startup.start` built for the loop, in its order."""

    place: Place
    """This rank, the world, the device, the ranks' host names."""
    guard: RunGuard
    flag_group: Any
    """The group of the end-of-step agreement: a CPU (gloo) one on accelerators, None for the default group."""
    run_dir: RunDirectory
    checkpoints: CheckpointManager
    snapshots: Snapshots | None
    """The run's memory snapshots, when it takes them (checkpoint.memory_every)."""
    engine: Any
    """DeepSpeed's engine around the model."""
    state: TrainState
    """The resumable state, loaded from ``resumed_from`` already (or fresh)."""
    resumed_from: str | None
    """The checkpoint's tag the state was loaded from; None for a fresh start."""
    init_from: dict[str, Any] | None = None
    """Where the run started from (train.init_from's record), named in every start's logs."""


class Trainer:
    """The training loop over the facts resolved once (`ResolvedRun`: the config, the manifest, the tokenizer's
    fingerprint, the batch split) and the parts `txl_dist.training.startup.start` built (`RunParts`, the state
    loaded already); `run()` trains and returns a summary."""

    def __init__(self, run: ResolvedRun, parts: RunParts):
        cfg = self.cfg = run.cfg
        self.launcher = run.launcher
        self.init_from = parts.init_from
        self.manifest = run.manifest
        self.fingerprint = run.tokenizer_fingerprint
        self.place = parts.place
        self.rank, self.world_size, self.device = parts.place.rank, parts.place.world_size, parts.place.device
        self.device_type = self.device.type
        self.guard = parts.guard
        self._flag_group = parts.flag_group
        self.run_dir = parts.run_dir
        self.checkpoints = parts.checkpoints
        self.snapshots = parts.snapshots
        self.engine = engine = parts.engine
        self.num_parameters = run.num_parameters
        self.state = parts.state
        self.streams, self.memories = self.state.streams, self.state.memories
        # Byte and character tokenizers: the loss per token in bits is the bits per character, logged as bpc.
        self.character_level = run.manifest.tokenizer.kind in CHARACTER_KINDS
        self.batch_split = run.batch_split
        self.cadence = Cadence.of(cfg)
        self.tokens_per_step = cfg.train.global_batch * cfg.model.tgt_len
        self.resumed_from = parts.resumed_from
        self.logger = RunLogger(
            self.run_dir.path, enabled=self.rank == 0, tensorboard=cfg.log.tensorboard, resume_step=self.state.step
        )
        self.checkpoints.on_complete = self._saved  # the manager owns the saves' lifecycle; the trainer, their lines
        self.numerics = NumericsGuard(
            cfg,
            state=self.state,
            engine=engine,
            checkpoints=self.checkpoints,
            snapshots=self.snapshots,
            record=run.numerics_record,
            logger=self.logger,
            guard=self.guard,
        )
        self.numerics.started_from(self.resumed_from)
        self.health: StepHealth | None = None
        """The last step's numbers, as the ranks agreed on them: what a checkpoint of that step records."""
        # fp32 ZeRO-0 steps torch's optimizer with no DeepSpeed wrapper, which reports no gradient norm: it is
        # measured here, before the update.
        self._measure_grad_norm = cfg.zero.stage == 0 and cfg.precision.dtype == "fp32"
        self._stopped_sick = False
        """Stopped at a step that failed the check: no last checkpoint, so the memory snapshots stay."""

    # ---- checkpoint --------------------------------------------------------------------------------------------

    def save(self) -> str:
        """Collective: a checkpoint of this step (`CheckpointManager.save`): written now, or with
        checkpoint.background copied now and written while training goes on, complete a step or more later, at the
        ranks' agreement (`_agree`); returns its tag. The stall counts from here, the state's copy included."""
        started = time.perf_counter()
        save = self.checkpoints.save(
            self.engine,
            self._record(),
            self.state.client_state(),
            self.state.rank_state(),
            best_tag=self.state.best_tag(),
            background=self.cfg.checkpoint.background,
            started=started,
        )
        self._last_save_clock = time.monotonic()
        if save.background:
            self.logger.info(
                "checkpoint %s: training waited %.2f s (the state copied to host memory); writing it in the background",
                self.checkpoints.directory / save.tag,
                save.stall,
            )
        return save.tag

    def _record(self) -> CheckpointRecord:
        """What a checkpoint or snapshot of this step records (`CheckpointRecord`), with the step's health."""
        health = self.health.record() if self.health is not None else None
        return self.state.record(self.engine.zero_optimization_stage(), health)

    def _saved(self, save: Save) -> None:
        """`CheckpointManager.on_complete`: a checkpoint is complete (every rank's files written): its log line,
        with the seconds training waited for it (the stall) and the seconds of the write."""
        megabytes = save.bytes / 1e6
        if save.background:
            self.logger.info(
                "checkpoint %s complete at step %d: written in the background in %.2f s (%.1f MB), training waited "
                "%.2f s for it%s",
                self.checkpoints.directory / save.tag,
                self.state.step,
                save.seconds,
                megabytes,
                save.stall,
                " (and for the end of this write: the next save had come)" if save.waited else "",
            )
        else:
            self.logger.info(
                "checkpoint %s written in %.2f s (%.1f MB, %.0f MB/s), training waiting for all of it",
                self.checkpoints.directory / save.tag,
                save.seconds,
                megabytes,
                megabytes / max(save.seconds, 1e-9),
            )
        self.guard.checkpointed(save.record.step)

    def _snapshot(self) -> None:
        """Collective: a memory snapshot of this step (`txl_dist.checkpoints.snapshots`)."""
        jobs, tag_dir = self.checkpoints.snapshot_jobs(
            self.engine,
            self.state.step,
            self.state.client_state(),
            self.state.rank_state(),
            scratch=self.snapshots.scratch(),
        )
        stall = self.snapshots.take(jobs, tag_dir, self._record())
        if stall is not None:
            self.guard.snapshotted(self.state.step)
            self.logger.info("memory snapshot of step %d: training waited %.2f s", self.state.step, stall)

    # ---- evaluation --------------------------------------------------------------------------------------------

    def validate(self, max_batches: int) -> EvalResult:
        e = self.cfg.eval.resolve(self.cfg.model)
        module: TransformerXLLM = self.engine.module
        # eval.batch_size counts streams over all ranks.
        per_rank = max(1, math.ceil(e.batch_size / self.world_size))
        segment = SegmentSettings(e.tgt_len, e.mem_len, e.clamp_len, e.same_length)
        with EvalStreams(
            self.cfg.data.shards,
            e.split,
            tgt_len=e.tgt_len,
            batch_size=per_rank,
            world_size=self.world_size,
            rank=self.rank,
            expected_fingerprint=self.fingerprint,
            manifest=self.manifest,
        ) as streams:
            return evaluate(module, streams, self.device, max_batches=max_batches, segment=segment)

    def _validate_and_track(self, max_batches: int) -> EvalResult:
        result = self.validate(max_batches)
        values = {"loss": result.loss, "ppl": result.ppl, "targets": result.targets}
        if self.character_level:
            values["bpc"] = result.loss / math.log(2)
        self.logger.record(self.state.step, "eval", values)
        self.logger.info(
            "step %d | eval loss %.4f | eval ppl %.2f%s | %d targets",
            self.state.step,
            result.loss,
            result.ppl,
            f" | eval bpc {values['bpc']:.4f}" if self.character_level else "",
            result.targets,
        )
        # Only full passes are compared: a sampled evaluation (eval.max_batches) scores other tokens.
        state = self.state
        if max_batches == 0 and (state.best is None or result.loss < state.best["loss"]):
            state.best = {"step": state.step, "loss": result.loss, "ppl": result.ppl, "targets": result.targets}
        log_best(self.logger, state.step, state.best, self.character_level)
        return result

    # ---- the loop ----------------------------------------------------------------------------------------------

    def _forward(self, batch, mems: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One micro-batch through the engine, queued without waiting for the device: the batch is copied from
        pinned host memory with non_blocking, and the adaptive softmax's cluster rows (which rows go to which
        cluster, the only data-dependent shapes of the step) are found from the host copy of the targets."""
        rows = self.engine.module.cluster_rows(batch.targets, self.device)
        return self.engine(
            to_device(batch.inputs, self.device), to_device(batch.targets, self.device), mems, cluster_rows=rows
        )

    def _agree(
        self, step_loss: torch.Tensor, own_grad_norm: torch.Tensor | None, overflow: bool
    ) -> tuple[bool, bool, StepHealth]:
        """Collective, after every step: (a stop was requested on any rank, rank 0's clock says a save is due, the
        step's numbers). One all-reduce of the sum carries them, and whether any rank's background checkpoint
        write is still going: when none is, the pending checkpoint is completed here, at the same step on every
        rank. Only rank 0 reads the clock, so the ranks cannot disagree. The numbers: this rank's loss of the step
        (``step_loss``, on the device), the gradient norm (the engine's, else ``own_grad_norm``), whether this
        rank's loss was not finite and which rank it is, and in fp16 whether the scaler skipped the update
        (``overflow``) at its minimum scale; every rank gets the same `StepHealth`."""
        clock_due = self.rank == 0 and self.cadence.clock_save_due(time.monotonic(), self._last_save_clock)
        writing = self.checkpoints.writing()
        norm = self.engine.get_global_grad_norm()
        norm = own_grad_norm if norm is None else norm
        pinned = overflow and (loss_scale(self.engine.optimizer) or 0) <= self.cfg.precision.min_loss_scale
        host = [float(self.guard.requested), float(clock_due), float(writing), float(overflow), float(pinned)]
        flag_device = self.device if self._flag_group is None else torch.device("cpu")
        values = torch.cat(
            [
                step_numbers(step_loss, norm, self.rank).to(flag_device),
                torch.tensor(host, dtype=torch.float64, device=flag_device),
            ]
        )
        dist.all_reduce(values, group=self._flag_group)
        numbers, (stopping, clock_due, writing, overflow, pinned) = values[:4].tolist(), values[4:].tolist()
        self.checkpoints.poll(writing_anywhere=writing > 0)
        health = agreed_health(numbers, self.world_size, norm is not None, overflow > 0, pinned > 0)
        return stopping > 0, clock_due > 0, health

    def run(self) -> dict[str, Any]:
        log_start(
            self.logger,
            self.cfg,
            self.num_parameters,
            self.place,
            self.launcher,
            self.state.step,
            self.manifest.tokenizer.kind,
            self.init_from,
        )
        self.engine.train()
        start_step, run_start = self.state.step, time.perf_counter()
        try:
            with out_of_memory_snapshot(self.run_dir.path, self.rank, self.device, lambda: self.state.step):
                stopped_by, last_eval = self._train()
                # The last checkpoint is complete before the run reports its end.
                self.checkpoints.finish()
                if self.snapshots is not None and not self._stopped_sick:  # the last checkpoint is newer
                    self.snapshots.remove()
        finally:
            self.streams.close()
        elapsed = time.perf_counter() - run_start
        summary = {
            "steps": self.state.step,
            "steps_this_run": self.state.step - start_step,
            "tokens_seen": self.state.tokens_seen,
            "seconds": elapsed,
            "tokens_per_s": (self.state.step - start_step) * self.tokens_per_step / max(elapsed, 1e-9),
            "stopped_by": stopped_by,
            "eval_loss": last_eval.loss if last_eval else None,
            "eval_ppl": last_eval.ppl if last_eval else None,
            "best": self.state.best,
            "output_dir": str(self.run_dir.path),
        }
        log_done(self.logger, summary)
        self.logger.close()
        self.run_dir.release()
        self.guard.close()
        return summary

    def _train(self) -> tuple[str, EvalResult | None]:
        """Steps until the cadence or a stop request ends the run; returns why it ended and the last evaluation."""
        step_log = StepLog(
            self.logger,
            self.device,
            world_size=self.world_size,
            tokens_per_step=self.tokens_per_step,
            fp16=self.cfg.precision.dtype == "fp16",
            character_level=self.character_level,
            flops=FlopsMeter.of(self.cfg, self.world_size, self.batch_split.micro_batch, self.device),
            max_steps=self.cfg.train.max_steps,
        )
        batches = iter(self.streams)
        start_step, last_eval = self.state.step, None
        self._last_save_clock = time.monotonic()
        last_saved = self.state.step if self.resumed_from else None
        profiler = StepProfiler(self.cfg.profile, self.run_dir.path, self.rank, self.device, start_step + 1)
        phase = profiler.phase
        try:
            while (stopped_by := self.cadence.stop_before(self.state.step, self.streams.epoch)) is None:
                if self.numerics.apply_due_skips():
                    batches = iter(self.streams)
                profiler.before_step(self.state.step + 1, self.engine)
                with profiler.step_range(self.state.step + 1):
                    step_loss, grad_norm, overflow, memoryless = self._train_step(batches, step_log, phase)
                    with phase("stop agreement"):
                        stopping, clock_due, self.health = self._agree(step_loss, grad_norm, overflow)
                    if not self.cfg.numerics.check:  # on: a rollback replays it first (`NumericsGuard.recover`)
                        self.numerics.require_finite_after_resume(self.health.loss, self.state.step)
                    fault = self.numerics.judge(self.health, memoryless)
                    if fault is not None:
                        step_log.reset()
                        if stopping:  # nothing sick is saved: the next start goes back to the newest healthy state
                            self.logger.info("step %d failed the check as the run stops: nothing saved", fault.step)
                            self._stopped_sick = True
                            return self.guard.reason or "a stop request on another rank", last_eval
                        with phase("rollback"):
                            last_saved = self.numerics.recover(fault)
                        batches = iter(self.streams)
                    else:
                        if profiler.active:
                            step_log.profiled = True
                        if self.cadence.log_after(self.state.step):
                            step_log.write(self.state.step, self.state.tokens_seen, self.engine, self.memories)
                        self.numerics.after_healthy_step(self.health)
                        if evaluated := self.cadence.evaluate_after(self.state.step):
                            with phase("evaluation"):
                                last_eval = self._validate_and_track(self.cfg.eval.max_batches)
                        best = self.state.best
                        new_best = evaluated and best is not None and best["step"] == self.state.step
                        if self.cadence.save_after(
                            self.state.step, stopping=stopping, new_best=new_best, clock_due=clock_due
                        ):
                            with phase("checkpoint"):
                                self.save()
                            last_saved = self.state.step
                        elif self.snapshots is not None and self.cadence.snapshot_after(self.state.step):
                            with phase("snapshot"):
                                self._snapshot()
                profiler.after_step(self.state.step)
                if fault is None and (evaluated or last_saved == self.state.step):
                    step_log.restart_clock()  # keep evaluation and saving out of tokens/s
                if stopping:
                    return self.guard.reason or "a stop request on another rank", last_eval
        finally:
            profiler.close(self.state.step)
        # A full pass over the split when training ends, then the last checkpoint, which records it.
        last_eval = self._validate_and_track(0)
        if last_saved != self.state.step:
            self.save()
        return stopped_by, last_eval

    def _train_step(self, batches, step_log: StepLog, phase) -> tuple[torch.Tensor, torch.Tensor | None, bool, bool]:
        """One optimizer step: grad_accum micro-batches, each carrying its slot's memory on; ``phase`` labels
        the parts of each for the profiler (`StepProfiler.phase`). Returns the step's loss on this rank (on the
        device), the gradient norm where this trainer measures it, whether the engine skipped the update (an
        overflow), and whether the step's memories started empty."""
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        grad_norm, memoryless = None, False
        skipped_before = self.engine.skipped_steps
        for slot in range(self.batch_split.grad_accum):
            with phase("data"):
                batch = next(batches)
            if batch.reset_mems:
                self.memories.clear(slot)
            memoryless = memoryless or self.memories[slot] is None  # an epoch's start, a skipped window, a re-cut
            with phase("forward"):
                loss, mems = self._forward(batch, self.memories[slot])
                self.memories.update(slot, mems)
                loss = loss.mean()
            with phase("backward"):
                self.engine.backward(loss)
            if self._measure_grad_norm and slot + 1 == self.batch_split.grad_accum:
                grad_norm = gradient_norm(self.engine.module)
            with phase("optimizer step"):
                self.engine.step()
            step_loss += loss.detach().double() / self.batch_split.grad_accum
            step_log.add(batch)
        self.state.step += 1
        self.guard.progress(self.state.step)
        self.state.tokens_seen += self.tokens_per_step
        step_log.end_step(step_loss)
        return step_loss, grad_norm, self.engine.skipped_steps > skipped_before, memoryless
