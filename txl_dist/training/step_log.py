"""What a run's reports say: the training loop's log lines (`StepLog`: the first, one per window of steps since
the last, the last; `log_start`, `log_best`, `log_done`) and what a run is, as TensorBoard shows it (`texts`,
`hparams`). Where they are written: `txl_dist.training.run_log`.

The loss and the checksum of the data seen are summed on the device, micro-batch by micro-batch, without a host
synchronisation; a log line all-reduces them once. The checksum (each row's token sum, weighted by its stream id)
lets a test compare the data two runs trained on, step window by step window.

What a run is, as TensorBoard shows it: the Text tab's entries written at every start (the resolved config, the
environment, the model and its memory plan) and the HParams dashboard's hyperparameters (its metrics are the
run's scalars: ``eval/*``, the last evaluation, and ``best/*``, the best full pass).

The tags are stable (`TEXT_TAGS`), so that a run's starts line up as entries of one tag, each at the step it
started from.
"""

from __future__ import annotations

import collections
import math
import os
import platform
import resource
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from txl_dist.config import RunConfig
from txl_dist.model.flops import cluster_counts
from txl_dist.plan import describe, device_memory_of
from txl_dist.training.run_log import RunLogger
from txl_dist.training.throughput import FlopsMeter
from txl_dist.training.train_state import SlotMemories

TEXT_TAGS = ("run/config", "run/environment", "run/model")

RESTART_VARIABLES = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
"""What Slurm (a requeued job) and torchrun's elastic agent count; the run's own starts come from metrics.jsonl."""


def host_names() -> list[str]:
    """Collective: every rank's host name, by rank (one name in a world of one)."""
    name = socket.gethostname()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [name]
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, name)
    return names


def launcher(environ: os._Environ | dict[str, str] = os.environ) -> str:
    """The launcher that started this rank. `txl_dist.training.startup.apply_launch` writes torch's variables for
    every launcher and records the others' name in TXL_LAUNCHER; torchrun and DeepSpeed's per-node launcher are
    told apart by their own variables."""
    if environ.get("TXL_LAUNCHER"):
        return environ["TXL_LAUNCHER"]
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun"
    if "LOCAL_SIZE" in environ and "CROSS_RANK" in environ:
        return "deepspeed"
    return "torch's variables (RANK, WORLD_SIZE)" if "RANK" in environ else "single process"


def git_commit(source: Path | None = None) -> str | None:
    """The commit of the checkout this code runs from ("+ local changes" when it differs), None outside one."""
    source = source or Path(__file__).resolve().parents[2]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        # An installed package may sit inside someone else's repository: only this project's checkout counts.
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != source.resolve():
            return None
        commit = git("rev-parse", "HEAD").stdout.strip()
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit} + local changes" if changed else commit or None


def _versions() -> dict[str, str]:
    accelerator = get_accelerator()
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "accelerator": accelerator.device_name(),
    }
    if torch.cuda.is_available():
        versions["device"] = torch.cuda.get_device_name(torch.cuda.current_device())
        versions["cuda"] = str(torch.version.cuda)
        try:
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):  # a build without NCCL
            pass
    return versions


def environment(world_size: int, hosts: list[str], earlier_starts: int) -> dict[str, str]:
    """The environment entry's rows: versions, world, launcher, hosts, restarts, commit."""
    per_host = collections.Counter(hosts)
    restarts = {key: os.environ[key] for key in RESTART_VARIABLES if key in os.environ}
    rows = {
        **_versions(),
        "world size": str(world_size),
        "ranks per node": ", ".join(f"{count} on {host}" for host, count in per_host.items()),
        "launcher": launcher(),
        "hosts": ", ".join(per_host),
        "start": f"{earlier_starts + 1} (resumed {earlier_starts} time(s))"
        + "".join(f", {key}={value}" for key, value in restarts.items()),
        "git commit": git_commit() or "not a git checkout",
    }
    return rows


def _table(rows: dict[str, str]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {key} | {str(value).replace('|', '/')} |" for key, value in rows.items()]
    return "\n".join(lines)


def _preformatted(text: str) -> str:
    """Markdown code: TensorBoard's Markdown renders indented lines as they are."""
    return "\n".join("    " + line for line in text.splitlines())


def texts(
    cfg: RunConfig, num_parameters: int, world_size: int, device_type: str, rows: dict[str, str], plan: str
) -> dict[str, str]:
    """The Text tab's entries: `TEXT_TAGS` -> Markdown."""
    model = (
        f"{cfg.model_preset or 'model'}: {num_parameters:,} parameters, {cfg.model.n_layer} layers, d_model "
        f"{cfg.model.d_model}, {cfg.model.n_head} heads, n_token {cfg.model.n_token:,}; {world_size} rank(s) of "
        f"{device_type}\n\n{_preformatted(plan)}"
    )
    return dict(zip(TEXT_TAGS, (_preformatted(cfg.dump_yaml()), _table(rows), model)))


def hparams(cfg: RunConfig, world_size: int, tokenizer_kind: str) -> dict[str, float | int | str]:
    """The hyperparameters a sweep varies, under their config keys."""
    model = cfg.model
    return {
        "model.n_layer": model.n_layer,
        "model.d_model": model.d_model,
        "model.n_head": model.n_head,
        "model.tgt_len": model.tgt_len,
        "model.mem_len": model.mem_len,
        "model.dropout": model.dropout,
        "optim.lr": cfg.optim.lr,
        "train.global_batch": cfg.train.global_batch,
        "precision.dtype": cfg.precision.dtype,
        "zero.stage": cfg.zero.stage,
        "world_size": world_size,
        "tokenizer": tokenizer_kind,
    }


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
    world_size: int,
    device_type: str,
    step: int,
    tokenizer_kind: str = "",
    init_from: dict[str, Any] | None = None,
) -> None:
    """Collective (the ranks' host names): the run's first lines (its model, batch layout and steps, then the
    memory plan of a rank), and this start's TensorBoard text and HParams session (`txl_dist.training.step_log`)."""
    hosts = host_names()

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
        rows = environment(world_size, hosts, logger.earlier_starts)
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
