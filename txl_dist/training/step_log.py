"""What a run's reports say: the training loop's log lines (`StepLog`: the first, one per window of steps since
the last, the last; `log_start`, `log_best`, `log_done`) and what a run is, as TensorBoard shows it (`texts`,
`hparams`). Where they are written: `txl_dist.training.run_log`.

The loss and the checksum of the data seen are summed on the device, micro-batch by micro-batch, without a host
synchronisation; a log line all-reduces them once. The checksum (each row's token sum, weighted by its stream id)
lets a test compare the data two runs trained on, step window by step window.

At every start, `log_start` also writes what the run is, as TensorBoard shows it (`txl_dist.training.
run_environment`: the Text tab's entries and the HParams dashboard's hyperparameters, whose metrics are the run's
scalars: ``eval/*``, the last evaluation, and ``best/*``, the best full pass).
"""

from __future__ import annotations

import math
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from txl_dist.config import RunConfig
from txl_dist.model.flops import cluster_counts
from txl_dist.plan import describe, device_memory_of
from txl_dist.rendezvous.ranks import Place
from txl_dist.training.run_environment import environment, hparams, texts
from txl_dist.training.run_log import RunLogger
from txl_dist.training.throughput import FlopsMeter
from txl_dist.training.train_state import SlotMemories


def _resident_memory_mb() -> float:
    """Current resident set size of this process (Linux), in MiB."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            pages = int(handle.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    if torch.is_tensor(value):
        value = value.item()
    return float(value)


def loss_scale(optimizer: Any) -> float | None:
    """The dynamic loss scale of DeepSpeed's fp16 optimizers (ZeRO 0 keeps it in loss_scale_config)."""
    config = getattr(optimizer, "loss_scale_config", None)
    return _as_float(
        getattr(config, "cur_scale", None) if config is not None else getattr(optimizer, "cur_scale", None)
    )


def _memory() -> dict[str, float]:
    """This rank's memory for the log line: resident memory on the CPU, the device's peaks (allocated by tensors,
    reserved by the caching allocator) since the last line."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
        return {"rss_mb": _resident_memory_mb(), "peak_rss_mb": peak_kib / 1024}
    memory = {
        "max_allocated_mb": accelerator.max_memory_allocated() / 2**20,
        "max_reserved_mb": accelerator.max_memory_reserved() / 2**20,
    }
    accelerator.reset_peak_memory_stats()
    return memory


class StepLog:
    """The window of steps since the last log line, and the line (`write`) that closes it.

    ``flops``: the model FLOPs of the line; the adaptive softmax's share is counted from the window's targets in
    each cluster (over all ranks), which are the rows its tail clusters computed (docs/metrics.md)."""

    def __init__(
        self,
        logger: RunLogger,
        device: torch.device,
        *,
        world_size: int,
        tokens_per_step: int,
        fp16: bool,
        character_level: bool,
        flops: FlopsMeter,
        max_steps: int | None = None,
    ):
        self.logger = logger
        self.flops = flops
        self.cluster_counts = torch.zeros(len(flops.model.cutoffs) + 1, dtype=torch.int64)
        """The window's targets in each softmax cluster (head first), on the host like the targets."""
        self.described = False
        """Whether this start's FLOPs per token and its parts have been logged."""
        self.max_steps = max_steps
        self.world_size, self.tokens_per_step = world_size, tokens_per_step
        self.fp16, self.character_level = fp16, character_level
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        """The window's summed mean loss per step, on the device."""
        self.checksum = torch.zeros((), dtype=torch.int64)
        self.steps = 0
        self.start = time.perf_counter()
        self.said_mfu = False
        """Whether an MFU above 100% (a peak set too low) has been said."""
        self.profiled = False
        """Some step of the window ran under the profiler (profile.steps): its record says so, as its tokens/s
        includes the profiler's cost."""

    def add(self, batch) -> None:
        """One micro-batch's inputs."""
        self.checksum += (batch.inputs.sum(dim=1) * (batch.stream_ids + 1)).sum()
        counts = cluster_counts(batch.targets, self.flops.model.cutoffs)
        if not self.described:  # this start's first micro-batch
            self.logger.info("%s", self.flops.describe(counts.tolist()))
            self.described = True
        self.cluster_counts += counts

    def end_step(self, step_loss: torch.Tensor) -> None:
        """The step's mean loss on this rank (on the device)."""
        self.loss += step_loss
        self.steps += 1

    def reset(self) -> None:
        """A new window from the next step: the steps since the last line are gone (a rollback)."""
        self.loss.zero_()
        self.checksum.zero_()
        self.cluster_counts.zero_()
        self.steps = 0
        self.profiled = False
        self.restart_clock()

    def restart_clock(self) -> None:
        """Keep what came since the last step (an evaluation, a save) out of the window's tokens/s."""
        self.start = time.perf_counter()

    def write(self, step: int, tokens_seen: int, engine, memories: SlotMemories) -> None:
        """Collective: the window's line (loss over all ranks, throughput, optimizer state), then a new window."""
        counts = self.cluster_counts.to(self.loss.device, torch.float64)
        totals = torch.cat([torch.stack([self.loss, self.checksum.to(self.loss.device, torch.float64)]), counts])
        dist.all_reduce(totals)
        totals = totals.tolist()
        loss = totals[0] / (self.steps * self.world_size)
        seconds = time.perf_counter() - self.start
        memory = _memory()
        tokens_per_s = self.steps * self.tokens_per_step / max(seconds, 1e-9)
        model_flops = self.flops.figures(totals[2:], tokens_per_s)
        if (model_flops["mfu"] or 0) > 1 and not self.said_mfu:
            self.said_mfu = True
            self.logger.warning(
                "MFU %.3g%% is above 100%%: train.peak_tflops=%g is below the %.3g TFLOPS per rank this run "
                "achieves; set the device's real peak",
                100 * model_flops["mfu"],
                self.flops.peak_tflops,
                model_flops["tflops"],
            )
        values = {
            "loss": loss,
            "ppl": math.exp(min(loss, 50.0)),
            "lr": engine.get_lr()[0],
            "grad_norm": _as_float(engine.get_global_grad_norm()),
            "loss_scale": loss_scale(engine.optimizer) if self.fp16 else None,
            "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
            "tokens": tokens_seen,
            "tokens_per_s": tokens_per_s,
            **model_flops,
            "step_time_s": seconds / self.steps,
            "data_checksum": int(totals[1]),
            "mems_reset": memories.reset_total(),
            **memory,
        }
        if self.character_level:
            values["bpc"] = loss / math.log(2)
        if self.profiled:
            values["profiled"] = True
        self.logger.record(step, "train", values, keep_null=("mfu",))
        self.logger.info(
            "step %d | loss %.4f | %s | lr %.3g | grad norm %s | %.0f tokens/s%s | %s | %s",
            step,
            loss,
            f"bpc {values['bpc']:.4f}" if self.character_level else f"ppl {values['ppl']:.2f}",
            values["lr"],
            "-" if values["grad_norm"] is None else f"{values['grad_norm']:.3f}",
            values["tokens_per_s"],
            _eta(self.max_steps, step, seconds / self.steps),
            _model_flops_columns(model_flops),
            " | ".join(f"{k} {v:.0f}" for k, v in memory.items()) + (" | profiled" if self.profiled else ""),
        )
        self.reset()


def _model_flops_columns(figures: dict[str, float | None]) -> str:
    """ "1.23e+06 FLOPs/token | 0.0456 TFLOPS/rank | MFU 12.3%" (MFU "-" where no peak is known)."""
    mfu = "-" if figures["mfu"] is None else f"{100 * figures['mfu']:.1f}%"
    return f"{figures['flops_per_token']:.3g} FLOPs/token | {figures['tflops']:.3g} TFLOPS/rank | MFU {mfu}"


def _eta(max_steps: int | None, step: int, step_seconds: float) -> str:
    """ ", ETA 1h02m to step N" from the window's time per step (this start's steps only, so a resumed run's
    downtime does not count); empty at max_steps or without one."""
    if not max_steps or step >= max_steps:
        return ""
    seconds = round((max_steps - step) * step_seconds)
    hours, rest = divmod(seconds, 3600)
    shown = f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"
    return f", ETA {shown} to step {max_steps}"


def log_start(
    logger: RunLogger,
    cfg: RunConfig,
    num_parameters: int,
    place: Place,
    launcher: str,
    step: int,
    tokenizer_kind: str = "",
    init_from: dict[str, Any] | None = None,
) -> None:
    """The run's first lines (its model, batch layout and steps, then the memory plan of a rank), and this start's
    TensorBoard text and HParams session (`txl_dist.training.run_environment`), from the facts resolved once:
    ``place`` (the ranks, their host names), ``launcher`` (`LaunchEnvironment.name`)."""
    world_size, device_type = place.world_size, place.device.type
    layout = cfg.train.batch_split(world_size)
    logger.info(
        "training %s (%d parameters) on %d rank(s): global batch %d = %d ranks x micro-batch %d x %d "
        "accumulation, %d tokens/step, from step %d to %d",
        cfg.model_preset or "model",
        num_parameters,
        world_size,
        cfg.train.global_batch,
        world_size,
        layout.micro_batch,
        layout.grad_accum,
        cfg.train.global_batch * cfg.model.tgt_len,
        step,
        cfg.train.max_steps,
    )
    plan = describe(cfg, world_size, device_type, device_memory_of(device_type))
    logger.info("%s", plan)
    if logger.enabled:
        rows = environment(world_size, place.hosts, launcher, logger.earlier_starts)
        if init_from is not None:
            rows["init from"] = f"{init_from['kind']} {init_from['path']} (sha256 {init_from['sha256']})"
        logger.start(
            step,
            texts(cfg, num_parameters, world_size, device_type, rows, plan),
            hparams(cfg, world_size, tokenizer_kind),
            {"init_from": init_from} if init_from is not None else {},
        )


def log_best(logger: RunLogger, step: int, best: dict[str, Any] | None, character_level: bool) -> None:
    """The best full evaluation so far, as ``best/*`` scalars at every evaluation (the HParams metrics)."""
    if best is None:
        return
    values = {"loss": best["loss"], "ppl": best["ppl"]}
    if character_level:
        values["bpc"] = best["loss"] / math.log(2)
    logger.record(step, "best", values)


def log_done(logger: RunLogger, summary: dict[str, Any]) -> None:
    """The run's last line, from the summary `Trainer.run` returns; a run that reached its end (not one stopped
    by a signal, which resumes later) also ends its HParams session."""
    if summary["stopped_by"].startswith(("max_steps=", "max_epochs=")):
        logger.end(summary["steps"])
    logger.info(
        "done: %d steps (%d this run) in %.1f s, %.0f tokens/s, stopped by %s%s",
        summary["steps"],
        summary["steps_this_run"],
        summary["seconds"],
        summary["tokens_per_s"],
        summary["stopped_by"],
        f", valid ppl {summary['eval_ppl']:.2f}" if summary["eval_ppl"] is not None else "",
    )
