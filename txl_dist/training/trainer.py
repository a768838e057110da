"""The training loop: DeepSpeed ZeRO data parallelism with per-rank contiguous streams and coherent mems.

Every optimizer step runs grad_accum micro-batches per rank. Micro-batch slot k of a rank always holds the same
global streams (consecutive ids), and its rows continue exactly where the previous step's rows ended, so the
memory of slot k (n_layer + 1 tensors [mem_len, micro_batch, d_model]) always belongs to the text that follows
-- the authors' ``batch_chunk``, made distributed. The memory is detached after every forward.

A checkpoint holds DeepSpeed's engine state, the client state (step, tokens seen, data position, resolved config,
best validation result) and, per rank, the memory of each stream by stream id plus the RNG states (see
`txl_dist.training.checkpoint`). Rerunning the same command resumes from the newest complete checkpoint. With the
same number of streams (whatever the world size) streams and memory continue exactly; with another number the
data is re-partitioned and the memory starts empty (the log says so).

SIGTERM or SIGINT (what Slurm sends before preemption) finishes the current step, writes a checkpoint and exits
with status 0; the ranks agree on the step through an all-reduce of the stop flag after every step. So does the
end of the process that started the job (see `txl_dist.training.run_guard`: no rank trains on as an orphan).

The run owns its output directory: rank 0 holds ``run.lock`` (`txl_dist.training.run_lock`) from start to exit,
and every rank must read back that lock's token before anything else happens, which proves that all nodes see the
same directory. Rank 0 chooses the checkpoint to resume from (the newest that verifies, the ranks sharing the
reading) and tells the others. A non-finite loss on the first step after a resume stops the run. A stream whose
new memory holds inf/nan (an fp16 forward that overflowed) gets a zero memory instead, counted in the logged
``mems_reset``, so no later segment carries it and no checkpoint stores it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from txl_dist.config import RunConfig, with_manifest_vocab
from txl_dist.data import EvalStreams, ResumeKind, TrainStreams
from txl_dist.data.format import read_manifest
from txl_dist.evaluation import EvalResult, evaluate, to_device
from txl_dist.model import TransformerXLLM
from txl_dist.model.recurrence import SegmentSettings
from txl_dist.plan import describe, device_memory_of
from txl_dist.tokenizer import CHARACTER_KINDS
from txl_dist.training import weights_only, world
from txl_dist.training.checkpoint import (
    CLIENT_KEY,
    CheckpointManager,
    RankState,
    refuse_another_architecture,
    refuse_another_zero_stage,
    refuse_fresh_start,
    rng_state,
    set_rng_state,
    tag_for_step,
)
from txl_dist.training.deepspeed_config import build_deepspeed_config, build_torch_optimizer
from txl_dist.training.run_guard import RunFailure, RunGuard
from txl_dist.training.run_lock import LOCK_NAME, RunLock, read_holder
from txl_dist.training.run_logger import RunLogger
from txl_dist.training.schedule import build_lr_scheduler

log = logging.getLogger("txl_dist.training")


SHARED_DIRECTORY_WAIT_S = 10.0
"""How long a rank looks for rank 0's lock file before it decides that its node sees another directory (NFS
clients may cache a lookup for a few seconds)."""


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


def _loss_scale(optimizer: Any) -> float | None:
    """The dynamic loss scale of DeepSpeed's fp16 optimizers (ZeRO 0 keeps it in loss_scale_config)."""
    config = getattr(optimizer, "loss_scale_config", None)
    return _as_float(
        getattr(config, "cur_scale", None) if config is not None else getattr(optimizer, "cur_scale", None)
    )


def _tokenizer_fingerprint(directory: str | None) -> str | None:
    """data.tokenizer's fingerprint, checked against its files only: the command line has loaded and checked the
    whole tokenizer already, and every rank parsing a 1M-word vocabulary again costs about a second."""
    if directory is None:
        return None
    from txl_dist.tokenizer import verified_fingerprint

    return verified_fingerprint(directory)


def _finite_mems(mems: list[torch.Tensor], resets: torch.Tensor) -> list[torch.Tensor]:
    """``mems`` (n_layer + 1 tensors [mem_len, B, d_model]) with the columns (streams) that hold inf or nan in any
    layer set to zero -- the memory HuggingFace's Transformer-XL starts from -- and their number added to
    ``resets``; all on the device, without a host synchronisation."""
    finite = torch.stack([m.isfinite().all(dim=2).all(dim=0) for m in mems]).all(dim=0)  # [B]
    resets += (~finite).sum()
    keep = finite.view(1, -1, 1)
    return [torch.where(keep, m, torch.zeros((), dtype=m.dtype, device=m.device)) for m in mems]


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Trainer:
    """Builds everything from a validated `RunConfig`; `run()` trains and returns a summary.

    ``guard``: the process's `RunGuard` (launchers/train.py creates it first thing, so that signals and the
    launcher chain are watched from the start); one is made here when not given."""

    def __init__(self, cfg: RunConfig, deepspeed_overlay: str | None = None, guard: RunGuard | None = None):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self.guard = guard if guard is not None else RunGuard()

        self.accelerator = get_accelerator()
        self.device_type = self.accelerator.device_name()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.device_type != "cpu":
            # A launcher that binds one device per task (srun --gpus-per-task) leaves each rank one visible device.
            device_index = local_rank % max(self.accelerator.device_count(), 1)
            self.accelerator.set_device(device_index)
            self.device = torch.device(self.device_type, device_index)
        else:
            self.device = torch.device("cpu")
        self.rank, self.world_size, self.rank_environments = world.start(self.device_type)
        self.guard.connect(self.rank, self.world_size, cfg.train.stall_timeout)
        if self.rank == 0:
            log.info(
                "ranks' environment: %s on %s",
                world.describe_environment(self.rank_environments[0]),
                ", ".join(sorted({record["host"] for record in self.rank_environments})),
            )
        # The per-step stop-flag agreement goes over a CPU (gloo) group on accelerators, so that reading the flag
        # does not wait for the device to finish the step's kernels.
        self._flag_group = dist.new_group(backend="gloo") if self.device_type != "cpu" else None

        manifest = read_manifest(cfg.data.shards)
        cfg = with_manifest_vocab(cfg, manifest.tokenizer.vocab_size, f"{cfg.data.shards}/manifest.json")
        self.cfg = cfg
        self.manifest = manifest
        # Byte and character tokenizers: the loss per token in bits is the bits per character, logged as bpc.
        self.character_level = manifest.tokenizer.kind in CHARACTER_KINDS
        self.layout = cfg.train.batch_layout(self.world_size)
        self.output_dir = Path(cfg.train.output_dir)
        self.lock = self._take_output_dir()
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints", self.rank, self.world_size, cfg.checkpoint.keep_last
        )
        self.guard.on_abort(self.checkpoints.remove_unfinished_save)
        self.checkpoints.remove_incomplete()
        if self.rank == 0:
            self._keep_tokenizer()
        dist.barrier()

        # Identical initial weights on every rank, then a different dropout stream per rank.
        torch.manual_seed(cfg.train.seed)
        model = TransformerXLLM(cfg.model)
        self.num_parameters = model.num_parameters()  # before ZeRO-3 partitions the parameters
        if cfg.model.compile:
            model.compile_body()  # the module itself stays: no "_orig_mod." keys in checkpoints
        torch.manual_seed(cfg.train.seed + 1_000_003 * self.rank)

        ds_config = build_deepspeed_config(
            train=cfg.train,
            optim=cfg.optim,
            precision=cfg.precision,
            zero=cfg.zero,
            world_size=self.world_size,
            device=self.device_type,
            overlay_path=deepspeed_overlay,
            num_parameters=self.num_parameters,
        )
        self.resume_tag = self._resume_tag()
        self.load_tag = self.resume_tag
        if self.resume_tag and self.checkpoints.needs_universal(self.resume_tag):
            self.load_tag = self.checkpoints.prepare_universal(self.resume_tag)
            ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        # No optimizer section: torch's fused Adam, built here (see build_deepspeed_config).
        optimizer = build_torch_optimizer(cfg.optim, model.parameters()) if "optimizer" not in ds_config else None
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            optimizer=optimizer,
            config=ds_config,
            lr_scheduler=lambda optimizer: build_lr_scheduler(optimizer, cfg.schedule, cfg.train.max_steps),
        )
        self.checkpoints.install(self.engine)
        self.fingerprint = _tokenizer_fingerprint(cfg.data.tokenizer) or manifest.tokenizer.fingerprint
        self.streams = TrainStreams(
            cfg.data.shards,
            cfg.data.train_split,
            tgt_len=cfg.model.tgt_len,
            micro_batch=self.layout.micro_batch,
            grad_accum=self.layout.grad_accum,
            world_size=self.world_size,
            rank=self.rank,
            seed=cfg.train.seed,
            shuffle_blocks=cfg.data.shuffle_blocks,
            expected_fingerprint=self.fingerprint,
            verify_sha256=cfg.data.verify_sha256,
        )
        self.step = 0
        self.tokens_seen = 0
        self.best: dict[str, Any] | None = None
        self.mems: list[list[torch.Tensor] | None] = [None] * self.layout.grad_accum
        self._mems_resets = torch.zeros((), dtype=torch.int64, device=self.device)
        self.resumed_from = self._resume()
        self.logger = RunLogger(
            self.output_dir, enabled=self.rank == 0, tensorboard=cfg.log.tensorboard, resume_step=self.step
        )

    def _take_output_dir(self) -> RunLock | None:
        """Collective: rank 0 takes the run lock (refused while another run holds it); then every rank must read
        that lock, token and all, from its own view of train.output_dir, or the run stops: nodes that see
        different directories would resume from different checkpoints and hang in their first collective."""
        lock = None
        if self.rank == 0:
            lock = RunLock(self.output_dir, on_lost=lambda message: self.guard.fail(RunFailure(message)))
            lock.acquire()
            self.guard.on_abort(lock.release)
        token, rank0_dir, rank0_host = _broadcast(
            (lock.token, str(self.output_dir.absolute()), socket.gethostname()) if lock else None
        )
        problem = None
        if self.rank != 0:
            path = self.output_dir / LOCK_NAME
            deadline = time.monotonic() + SHARED_DIRECTORY_WAIT_S
            while True:
                try:
                    holder = read_holder(path)
                except (OSError, ValueError):
                    holder = None
                if holder is not None and holder.token == token:
                    break
                if time.monotonic() > deadline:
                    found = "finds no" if holder is None else "finds another run's"
                    problem = (
                        f"train.output_dir must be on a filesystem shared by all nodes: rank {self.rank} on "
                        f"{socket.gethostname()} {found} {LOCK_NAME} in {path.parent.absolute()}, where rank 0 "
                        f"on {rank0_host} wrote this run's in {rank0_dir}"
                    )
                    break
                time.sleep(0.5)
        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        failed = [p for p in problems if p]
        if failed:
            raise RunFailure(failed[0] + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""))
        return lock

    def _keep_tokenizer(self) -> None:
        """Rank 0: a copy of the tokenizer in ``{output_dir}/tokenizer``, so that checkpoints convert and
        evaluate on any machine without the shards' build folders."""
        import shutil
        import tempfile

        from txl_dist.tokenizer import TokenizerError, find_tokenizer_dir, load_tokenizer

        target = self.output_dir / "tokenizer"
        candidates = [target, self.cfg.data.tokenizer, self.manifest.build.get("tokenizer_directory")]
        try:
            source = find_tokenizer_dir(self.manifest.tokenizer.fingerprint, candidates)
        except TokenizerError as error:
            log.warning("no copy of the tokenizer kept with the run (exports will need --tokenizer): %s", error)
            return
        if source == target:
            return
        tokenizer = load_tokenizer(source)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=self.output_dir))
        for name in [*tokenizer.files, "tokenizer.json"]:
            shutil.copyfile(source / name, staging / name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)

    # ---- resume ------------------------------------------------------------------------------------------------

    def _resume_tag(self) -> str | None:
        """Collective: the checkpoint to resume from (the newest that verifies, chosen on rank 0), checked against
        this run's architecture before anything is built."""
        if not self.cfg.checkpoint.resume:
            existing = self.checkpoints.complete_tags()
            if existing:
                refuse_fresh_start(self.checkpoints.directory, existing[-1])
            return None
        tag = self.checkpoints.choose_resume_tag(verify=self.cfg.checkpoint.verify)
        if tag is None:
            return None
        marker = self.checkpoints.marker(tag)
        refuse_another_architecture(self.checkpoints.directory, tag, marker, self.cfg.model.architecture())
        refuse_another_zero_stage(self.checkpoints.directory, tag, marker, self.cfg.zero.stage)
        return tag

    def _resume(self) -> str | None:
        tag = self.resume_tag
        if tag is None:
            return None
        with weights_only.deepspeed_loads_weights_only():
            _, client_state = self.engine.load_checkpoint(str(self.checkpoints.directory), tag=self.load_tag)
        if self.load_tag != tag:
            self.checkpoints.remove_universal(self.load_tag)
        if client_state is None or CLIENT_KEY not in client_state:
            raise RuntimeError(f"{self.checkpoints.directory / tag}: not a txl_dist checkpoint (no client state)")
        saved = client_state[CLIENT_KEY]
        self.step, self.tokens_seen, self.best = saved["step"], saved["tokens_seen"], saved.get("best")
        self.guard.progress(self.step)
        self.guard.checkpointed(self.step)
        kind = self.streams.load_state_dict(saved["data"])
        rng = None
        if kind == ResumeKind.EXACT:
            my_streams = [s for slot in range(self.layout.grad_accum) for s in self.streams.stream_ids(slot)]
            mems_by_stream, rng = self.checkpoints.load_rank_states(tag, my_streams)
            for slot in range(self.layout.grad_accum):
                ids = self.streams.stream_ids(slot)
                if all(i in mems_by_stream for i in ids):
                    layers = zip(*(mems_by_stream[i] for i in ids))
                    self.mems[slot] = [torch.stack(columns, dim=1).to(self.device) for columns in layers]
        else:
            log.warning("rank %d: the number of streams changed; memory starts empty", self.rank)
        if rng is not None:
            set_rng_state(rng)
        else:
            torch.manual_seed(self.cfg.train.seed + 1_000_003 * self.rank + 7919 * self.step)
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
                self.checkpoints.directory / tag,
                self.step,
                kind.value,
                self.tokens_seen,
            )
        return tag

    # ---- checkpoint --------------------------------------------------------------------------------------------

    def _client_state(self) -> dict[str, Any]:
        return {
            CLIENT_KEY: {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "data": self.streams.state_dict(),
                "config": self.cfg.to_dict(),
                "architecture": self.cfg.model.architecture(),
                "tokenizer": dataclasses.asdict(self.manifest.tokenizer),
                "best": self.best,
                "world_size": self.world_size,
                "layout": self.layout._asdict(),
            }
        }

    def save(self) -> str:
        stream_ids, columns = [], []
        for slot in range(self.layout.grad_accum):
            stream_ids += self.streams.stream_ids(slot)
            columns.append(self.mems[slot])
        if any(m is None for m in columns):
            mems = None
        else:
            mems = _finite_mems(
                [torch.cat([slot_mems[layer] for slot_mems in columns], dim=1) for layer in range(len(columns[0]))],
                self._mems_resets,
            )
            mems = [layer.cpu() for layer in mems]
        state = RankState(stream_ids=stream_ids, mems=mems, rng=rng_state(), world_size=self.world_size, rank=self.rank)
        best_tag = tag_for_step(self.best["step"]) if self.best else None
        tag = self.checkpoints.save(
            self.engine,
            self.step,
            self._client_state(),
            state,
            architecture=self.cfg.model.architecture(),
            best_tag=best_tag,
        )
        self.logger.info("checkpoint %s written", self.checkpoints.directory / tag)
        self.guard.checkpointed(self.step)
        return tag

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
        ) as streams:
            return evaluate(module, streams, self.device, max_batches=max_batches, segment=segment)

    def _validate_and_track(self, max_batches: int) -> EvalResult:
        result = self.validate(max_batches)
        values = {"loss": result.loss, "ppl": result.ppl, "targets": result.targets}
        if self.character_level:
            values["bpc"] = result.loss / math.log(2)
        self.logger.record(self.step, "eval", values)
        self.logger.info(
            "step %d | eval loss %.4f | eval ppl %.2f%s | %d targets",
            self.step,
            result.loss,
            result.ppl,
            f" | eval bpc {values['bpc']:.4f}" if self.character_level else "",
            result.targets,
        )
        # Only full passes are compared: a sampled evaluation (eval.max_batches) scores other tokens.
        if max_batches == 0 and (self.best is None or result.loss < self.best["loss"]):
            self.best = {"step": self.step, "loss": result.loss, "ppl": result.ppl, "targets": result.targets}
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

    def _stop_agreed(self, stop: RunGuard) -> bool:
        flag = torch.tensor([1.0 if stop.requested else 0.0])
        if self._flag_group is None:
            flag = flag.to(self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._flag_group)
        return bool(flag.item())

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        tokens_per_step = cfg.train.global_batch * cfg.model.tgt_len
        self.logger.info(
            "training %s (%d parameters) on %d rank(s): global batch %d = %d ranks x micro-batch %d x %d "
            "accumulation, %d tokens/step, from step %d to %d",
            cfg.model_preset or "model",
            self.num_parameters,
            self.world_size,
            cfg.train.global_batch,
            self.world_size,
            self.layout.micro_batch,
            self.layout.grad_accum,
            tokens_per_step,
            self.step,
            cfg.train.max_steps,
        )
        plan_device = "cpu" if self.device_type == "cpu" else self.device_type
        self.logger.info("%s", describe(cfg, self.world_size, plan_device, device_memory_of(plan_device)))
        stop = self.guard
        self.engine.train()
        batches = iter(self.streams)
        window_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        window_checksum = torch.zeros((), dtype=torch.int64)
        window_steps, window_start, run_start = 0, time.perf_counter(), time.perf_counter()
        start_step, last_eval, stopped_by = self.step, None, None
        last_saved = self.step if self.resumed_from else None
        try:
            while self.step < cfg.train.max_steps:
                # Checked before taking the step's first micro-batch, so the saved data position is exact.
                if cfg.train.max_epochs is not None and self.streams.epoch >= cfg.train.max_epochs:
                    stopped_by = f"max_epochs={cfg.train.max_epochs}"
                    break
                for slot in range(self.layout.grad_accum):
                    batch = next(batches)
                    if batch.reset_mems:
                        self.mems[slot] = None
                    loss, self.mems[slot] = self._forward(batch, self.mems[slot])
                    self.mems[slot] = _finite_mems(self.mems[slot], self._mems_resets)
                    loss = loss.mean()
                    self.engine.backward(loss)
                    self.engine.step()
                    window_loss += loss.detach().double() / self.layout.grad_accum
                    window_checksum += (batch.inputs.sum(dim=1) * (batch.stream_ids + 1)).sum()
                self.step += 1
                self.guard.progress(self.step)
                self.tokens_seen += tokens_per_step
                window_steps += 1
                if self.resumed_from and self.step == start_step + 1:
                    self._require_finite_loss_after_resume(window_loss)
                finished = self.step >= cfg.train.max_steps
                if self.step % cfg.log.every == 0 or finished:
                    self._log_train(window_loss, window_checksum, window_steps, window_start, tokens_per_step)
                    window_loss.zero_()
                    window_checksum.zero_()
                    window_steps, window_start = 0, time.perf_counter()
                evaluated = False
                if cfg.eval.every and self.step % cfg.eval.every == 0 and not finished:
                    last_eval = self._validate_and_track(cfg.eval.max_batches)
                    evaluated = True
                stop_now = self._stop_agreed(stop)
                improved = evaluated and self.best is not None and self.best["step"] == self.step
                periodic = cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and not finished
                if stop_now or improved or periodic:
                    self.save()
                    last_saved = self.step
                if evaluated or last_saved == self.step:  # keep evaluation and saving out of tokens/s
                    window_start = time.perf_counter()
                if stop_now:
                    stopped_by = stop.reason or "a stop request on another rank"
                    break
            if stopped_by is None or stopped_by.startswith("max_epochs"):
                # A full pass over the split when training ends, then the last checkpoint, which records it.
                last_eval = self._validate_and_track(0)
                if last_saved != self.step:
                    self.save()
        finally:
            self.streams.close()
        elapsed = time.perf_counter() - run_start
        summary = {
            "steps": self.step,
            "steps_this_run": self.step - start_step,
            "tokens_seen": self.tokens_seen,
            "seconds": elapsed,
            "tokens_per_s": (self.step - start_step) * tokens_per_step / max(elapsed, 1e-9),
            "stopped_by": stopped_by or f"max_steps={cfg.train.max_steps}",
            "eval_loss": last_eval.loss if last_eval else None,
            "eval_ppl": last_eval.ppl if last_eval else None,
            "best": self.best,
            "output_dir": str(self.output_dir),
        }
        self.logger.info(
            "done: %d steps (%d this run) in %.1f s, %.0f tokens/s, stopped by %s%s",
            summary["steps"],
            summary["steps_this_run"],
            elapsed,
            summary["tokens_per_s"],
            summary["stopped_by"],
            f", valid ppl {last_eval.ppl:.2f}" if last_eval else "",
        )
        self.logger.close()
        if self.lock is not None:
            self.lock.release()
        self.guard.close()
        return summary

    def _require_finite_loss_after_resume(self, step_loss: torch.Tensor) -> None:
        """Collective, once: a checkpoint whose weights or optimizer state hold inf/nan would otherwise train on
        with every step skipped, and save more such checkpoints."""
        total = step_loss.detach().clone()
        dist.all_reduce(total)
        loss = total.item()
        if not math.isfinite(loss):
            verified = "" if self.cfg.checkpoint.verify else " (its files were not verified: checkpoint.verify=false)"
            raise RunFailure(
                f"the training loss is {loss} at step {self.step}, the first step after resuming from "
                f"{self.checkpoints.directory / self.resumed_from}: the checkpoint's weights or optimizer state are "
                f"not finite{verified}. Nothing was saved; move that checkpoint aside to resume from the one before"
            )

    def _mems_reset_total(self) -> int:
        """Streams whose memory was reset since this process started, over all ranks (on logging steps only)."""
        total = self._mems_resets.clone()
        dist.all_reduce(total)
        return int(total.item())

    def _log_train(
        self,
        window_loss: torch.Tensor,
        window_checksum: torch.Tensor,
        window_steps: int,
        window_start: float,
        tokens_per_step: int,
    ) -> None:
        totals = torch.stack([window_loss, window_checksum.to(window_loss.device, torch.float64)])
        dist.all_reduce(totals)
        loss = totals[0].item() / (window_steps * self.world_size)
        seconds = time.perf_counter() - window_start
        if self.device_type == "cpu":
            peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
            memory = {"rss_mb": _resident_memory_mb(), "peak_rss_mb": peak_kib / 1024}
        else:
            memory = {"max_allocated_mb": self.accelerator.max_memory_allocated() / 2**20}
            self.accelerator.reset_peak_memory_stats()
        fp16 = self.cfg.precision.dtype == "fp16"
        values = {
            "loss": loss,
            "ppl": math.exp(min(loss, 50.0)),
            "lr": self.engine.get_lr()[0],
            "grad_norm": _as_float(self.engine.get_global_grad_norm()),
            "loss_scale": _loss_scale(self.engine.optimizer) if fp16 else None,
            "skipped_steps": int(getattr(self.engine, "skipped_steps", 0)),
            "tokens": self.tokens_seen,
            "tokens_per_s": window_steps * tokens_per_step / max(seconds, 1e-9),
            "step_time_s": seconds / window_steps,
            "data_checksum": int(totals[1].item()),
            "mems_reset": self._mems_reset_total(),
            **memory,
        }
        if self.character_level:
            values["bpc"] = loss / math.log(2)
        self.logger.record(self.step, "train", values)
        self.logger.info(
            "step %d | loss %.4f | %s | lr %.3g | grad norm %s | %.0f tokens/s | %s",
            self.step,
            loss,
            f"bpc {values['bpc']:.4f}" if self.character_level else f"ppl {values['ppl']:.2f}",
            values["lr"],
            "-" if values["grad_norm"] is None else f"{values['grad_norm']:.3f}",
            values["tokens_per_s"],
            " | ".join(f"{k} {v:.0f}" for k, v in memory.items()),
        )
