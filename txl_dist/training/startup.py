"""The start of a training run, in reading order, once `launchers/train.py` has parsed its command line
(`txl_dist.training.arguments`) and put its `RunGuard` in place. `run` is the whole sequence:

1. The run, resolved (`resolve`, on every rank, before any process group exists): the launch environment read once
   (`txl_dist.rendezvous.launch_env`: which launcher, this rank, the world), the config files and
   ``key.path=value`` overrides, the shards' manifest (read once; the vocabulary taken from it), the batch split
   for that world, the device, DeepSpeed's config (the ``--deepspeed_config`` overlay merged, the buckets sized by
   the model's parameters counted from its shape), the tokenizer's fingerprint and the run directory. A bad value
   fails on every rank at once with one line naming the key (exit 2), not after minutes of start-up; the node's
   first rank prints it. The result, `ResolvedRun` (`txl_dist.training.resolved`), holds each of those facts, and
   nothing after this step resolves them again (rank 0 still reads the tokenizer's files once, to copy them into
   a new run folder).
2. The launch environment applied (`apply_launch`): torch's variables written from the launch resolved in 1.
3. The ranks (`txl_dist.rendezvous.ranks.join`): the device, the rendezvous, the process group; the guard joins
   the other ranks' watch.
4. The run directory (`RunDirectory.take`: the run lock, the tokenizer kept beside the run).
5. The resume plan: a memory snapshot newer than the newest checkpoint becomes one
   (`txl_dist.checkpoints.snapshots`), then `CheckpointManager.plan_resume` chooses the checkpoint and how it loads.
6. The engine (`build_engine`): the model and DeepSpeed's engine.
7. The streams (`TrainStreams`), on the manifest of step 1.
8. The state (`txl_dist.training.train_state.resumed_state`): the `TrainState` over those streams, loaded with the
   engine from the resume plan's checkpoint.

The `Trainer` is built from the facts of step 1 and those parts (`RunParts`), trains, and the ranks leave the
process group.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from txl_dist.checkpoints.manager import CheckpointManager
from txl_dist.checkpoints.rank_state import dropout_seed
from txl_dist.checkpoints.snapshot_files import RUN_ID
from txl_dist.checkpoints.snapshots import Snapshots, run_id
from txl_dist.checkpoints.verify import preflight
from txl_dist.config import RunConfig, load_config
from txl_dist.data import TrainStreams
from txl_dist.data.format import MANIFEST_NAME, Manifest
from txl_dist.data.run_vocab import shards_manifest, with_shards_vocab
from txl_dist.exit_status import FAILURE, USAGE_ERROR, CommandFailure, print_error
from txl_dist.fileio import dangling_link
from txl_dist.model import TransformerXLLM
from txl_dist.plan.counts import ModelShape
from txl_dist.plan.report import device_memory_of, plan_comment, require_memory_fits
from txl_dist.rendezvous import launch_env, ranks
from txl_dist.run_paths import checkpoints_dir, fault_log, numerics_record
from txl_dist.supervision.guard import RunGuard
from txl_dist.tokenizer import load_tokenizer
from txl_dist.training.arguments import build_arg_parser
from txl_dist.training.deepspeed_config import build_deepspeed_config, build_torch_optimizer
from txl_dist.training.init_from import (
    OpenSource,
    load_source_weights,
    resolve_init_from,
    start_from,
)
from txl_dist.training.numerics import NumericsRecord
from txl_dist.training.profiling import start_memory_history
from txl_dist.training.resolved import ResolvedRun
from txl_dist.training.run_dir import RunDirectory, require_writable
from txl_dist.training.schedule import build_lr_scheduler
from txl_dist.training.train_state import resumed_state
from txl_dist.training.trainer import RunParts, Trainer

PROG = "train.py"


def detect_device() -> str:
    """DeepSpeed's accelerator: "cuda", "cpu", ..."""
    return get_accelerator().device_name()


# ---- 1. the run, resolved -------------------------------------------------------------------------------------


def read_launch(environ=os.environ) -> tuple[launch_env.LaunchEnvironment | None, launch_env.LaunchError | None]:
    """The launch this process is part of (torchrun, deepspeed, srun, mpirun, or a plain process), or why its
    variables make none: refused in step 2, once the command line and the config are known to be good."""
    try:
        return launch_env.resolve(environ), None
    except launch_env.LaunchError as error:
        return None, error


def _local_rank(launch: launch_env.LaunchEnvironment | None, args: argparse.Namespace) -> int | None:
    """This process's rank on its node (None: no launcher). Only the node's first rank prints a refused value,
    which every rank of a node finds alike (each node still prints its own: a node may see other files)."""
    if launch is not None and launch.launcher != "single":
        return launch.local_rank
    local = os.environ.get("LOCAL_RANK", "")
    return int(local) if local.isdigit() else args.local_rank


def resolve(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    world_size: int | None = None,
    device: str | None = None,
    open_source: OpenSource | None = None,
) -> ResolvedRun:
    """Step 1: the `ResolvedRun` of the parsed command line ``args`` (refusals as ``parser.prog``).

    Checks the whole tree, the batch split for ``world_size`` ranks (default: the launcher's world, else 1) on
    ``device`` (default: `detect_device`), the ``--deepspeed_config`` overlay, and takes model.n_token from the
    shards' manifest. With --print-config it prints the resolved config and its memory plan (`txl_dist.plan`, as
    YAML comments) and exits 0. Any error exits 2 with one line on stderr naming the key, its value and what is
    allowed; a train.output_dir that the surroundings refuse to write (read-only, no space, not permitted) exits 1
    with one line."""
    launch, launch_error = read_launch()
    if world_size is None:
        world_size = launch.world_size if launch is not None else 1
    try:
        if args.deepscale_config is not None:
            raise ValueError("--deepscale_config is DeepSpeed's deprecated spelling; use --deepspeed_config")
        cfg = load_config(args.config, args.overrides)
        manifest = shards_manifest(cfg)
        init_source = init_warning = None
        if cfg.train.init_from is not None:  # the model's architecture, its tokenizer checked against the shards'
            cfg, init_source, init_warning = resolve_init_from(cfg, manifest, open_source)
        cfg = with_shards_vocab(cfg, manifest)
        device = device or detect_device()
        num_parameters = ModelShape.of(cfg.model).parameters
        ds_config = build_deepspeed_config(
            train=cfg.train,
            optim=cfg.optim,
            precision=cfg.precision,
            zero=cfg.zero,
            world_size=world_size,
            device=device,
            overlay_path=args.deepspeed_config,
            num_parameters=num_parameters,
        )
        if args.print_config:
            sys.stdout.write(cfg.dump_yaml() + plan_comment(cfg, world_size, device, device_memory_of(device)))
            sys.stdout.flush()
            raise SystemExit(0)
        _require_run_paths(cfg, manifest)
        fingerprint = _require_a_run_that_can_start(cfg, manifest)
        record = NumericsRecord.read(numerics_record(cfg.train.output_dir))
        if device != "cpu":  # this rank's own device: no rank touches another's before the process group
            local_rank = _local_rank(launch, args) or 0
            require_memory_fits(cfg, world_size, device, device_memory_of(device, local_rank))
    except (ValueError, CommandFailure) as error:
        # A refused value exits 2; an output the surroundings refuse (read-only, no space) is a failure, 1.
        status = USAGE_ERROR if isinstance(error, ValueError) else FAILURE
        if _local_rank(launch, args) in (None, 0):  # every rank found the same: the node's first rank says it
            print_error(parser.prog, error)  # one line, without argparse's usage: the flags were fine, a value is not
        raise SystemExit(status) from None
    return ResolvedRun(
        cfg=cfg,
        manifest=manifest,
        batch_split=cfg.train.batch_split(world_size),
        tokenizer_fingerprint=fingerprint,
        device_type=device,
        launch=launch,
        launch_error=launch_error,
        deepspeed_overlay=args.deepspeed_config,
        deepspeed_config=ds_config,
        num_parameters=num_parameters,
        numerics_record=record,
        init_source=init_source,
        init_warning=init_warning,
        open_source=open_source,
    )


def parse_run_args(
    argv: Sequence[str] | None = None, *, world_size: int | None = None, device: str | None = None
) -> tuple[RunConfig, argparse.Namespace]:
    """Step 1 from an argv (tests, benchmarks): the validated RunConfig and the parsed flags."""
    parser = build_arg_parser()
    args = parser.parse_intermixed_args(argv)
    return resolve(parser, args, world_size=world_size, device=device).cfg, args


def _require_run_paths(cfg: RunConfig, manifest: Manifest | None) -> None:
    """The keys a config file may leave to the command line but a run cannot do without (``manifest``: that of
    data.shards, None where it has none)."""
    if cfg.data.shards is None:
        raise ValueError(
            "data.shards is not set: give the shard directory written by data_tools.build_shards, e.g. data.shards=DIR"
        )
    if cfg.train.output_dir is None:
        raise ValueError("train.output_dir is not set: give the run's directory, e.g. train.output_dir=runs/NAME")
    output_dir = Path(cfg.train.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"train.output_dir={cfg.train.output_dir!r}: a file, not a directory")
    shards = cfg.data.shards
    if dangling_link(shards) is not None:
        raise ValueError(f"data.shards={shards!r}: a symbolic link to {dangling_link(shards)}, which leads nowhere")
    if manifest is None:
        raise ValueError(
            f"data.shards={shards!r} is not allowed: a local directory holding {MANIFEST_NAME} (a "
            f"finished data_tools.build_shards output; its shard paths may be pipe: URLs)"
        )
    splits = manifest.splits
    # The evaluation split is read at the first evaluation and at the end of training: hours into a run.
    for key, split in (("data.train_split", cfg.data.train_split), ("eval.split", cfg.eval.split)):
        if split not in splits:
            raise ValueError(
                f"{key}={split!r}: {Path(shards, MANIFEST_NAME)} has no such split (it has "
                f"{sorted(splits)}); build it (data_tools.build_shards --split or --holdout) or set {key}"
            )
    require_writable(output_dir)


def _require_a_run_that_can_start(cfg: RunConfig, manifest: Manifest) -> str:
    """What the trainer would refuse only after every rank has started, found here from the files alone: a
    data.tokenizer other than the one the shards were built with, checkpoints in train.output_dir under
    checkpoint.resume=false, and a newest complete checkpoint of another architecture (`checkpoints.verify.preflight`:
    the rules of `refuse_to_start`, which the resume plan applies to the checkpoint it chooses once verified).
    Returns the tokenizer's fingerprint."""
    fingerprint = manifest.tokenizer.fingerprint
    if cfg.data.tokenizer is not None:
        try:
            found = load_tokenizer(cfg.data.tokenizer).fingerprint  # the whole tokenizer checked, once
        except ValueError as error:
            raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r}: {error}") from error
        if found != fingerprint:
            raise ValueError(
                f"data.tokenizer={cfg.data.tokenizer!r}: its fingerprint {found} differs from "
                f"{Path(cfg.data.shards, MANIFEST_NAME)}'s {fingerprint}: the shards were built with another "
                f"tokenizer"
            )
    preflight(
        checkpoints_dir(cfg.train.output_dir), resume=cfg.checkpoint.resume, architecture=cfg.model.architecture()
    )
    return fingerprint


# ---- 2. the launch environment applied ------------------------------------------------------------------------


def apply_launch(
    launch: launch_env.LaunchEnvironment | None, launch_error: launch_env.LaunchError | None = None
) -> launch_env.LaunchEnvironment:
    """Step 2: torch's variables written from the launch of step 1 (``launch``, or ``launch_error``: why the
    variables make none; both from `read_launch`); ValueError (one line) for a launch that cannot form one world,
    before anything has started."""
    # Before torch's variables are written: a process alone in the batch script of an allocation of several tasks
    # most likely lacks its `srun`, and would train on one task of the allocation.
    launch_env.refuse_lone_batch_process(os.environ)
    if launch_error is not None:
        raise launch_error
    launch = launch_env.apply(launch=launch)
    launch_env.require_resolvable_address(launch)
    return launch


def configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


# ---- 3-8. ranks, run directory, resume plan, engine, streams, state --------------------------------------------------


def build_engine(
    run: ResolvedRun,
    place: ranks.Place,
    checkpoints: CheckpointManager,
    initial_weights: dict[str, torch.Tensor] | None = None,
):
    """Step 6: the model and DeepSpeed's engine around it, from the config step 1 built (whichever way the resume
    plan's checkpoint loads: `CheckpointManager.load`). ``initial_weights``: the weights of train.init_from, for a
    run that starts fresh from them."""
    cfg = run.cfg
    # Identical initial weights on every rank, then a different dropout stream per rank.
    torch.manual_seed(cfg.train.seed)
    model = TransformerXLLM(cfg.model)
    if model.num_parameters() != run.num_parameters:  # the count of step 1 sized DeepSpeed's buckets
        raise RuntimeError(f"the model has {model.num_parameters()} parameters, its shape counted {run.num_parameters}")
    if initial_weights is not None:  # before DeepSpeed partitions the parameters (ZeRO-3), on every rank alike
        load_source_weights(model, initial_weights, f"train.init_from={cfg.train.init_from}")
        initial_weights.clear()
    if cfg.model.compile:
        model.compile_body()  # the module itself stays: no "_orig_mod." keys in checkpoints
    torch.manual_seed(dropout_seed(cfg.train.seed, place.rank))
    ds_config = copy.deepcopy(run.deepspeed_config)  # DeepSpeed may write into the dict it is given
    # No optimizer section: torch's fused Adam, built here (see build_deepspeed_config).
    optimizer = build_torch_optimizer(cfg.optim, model.parameters()) if "optimizer" not in ds_config else None
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=optimizer,
        config=ds_config,
        lr_scheduler=lambda optimizer: build_lr_scheduler(optimizer, cfg.schedule, cfg.train.max_steps),
    )
    checkpoints.install(engine)
    return engine


def restore_snapshots(
    cfg: RunConfig, place: ranks.Place, run_dir: RunDirectory, checkpoints: CheckpointManager
) -> Snapshots | None:
    """Step 5's first half, collective: the memory snapshots of this run. With checkpoint.memory_every and a
    resume, the newest usable one newer than the newest checkpoint that verifies is written back as a checkpoint
    (`Snapshots.restore`); then every snapshot an earlier start left in the nodes' memory is freed, since the
    resume reads none of them again (with checkpoint.memory_every=0 too, whose start takes none). Returns the
    run's `Snapshots` when it takes them."""
    memory_every, resume = cfg.checkpoint.memory_every, cfg.checkpoint.resume
    if not memory_every and not (run_dir.path / RUN_ID).exists():
        return None  # no snapshot was ever taken for this folder
    identity = run_id(run_dir.path, place.rank, cfg.checkpoint.memory_dir)
    hosts = list(place.hosts)
    snapshots = Snapshots(
        cfg.checkpoint.memory_dir, identity, run_dir.path, place.rank, place.world_size, hosts, bool(memory_every)
    )
    why = "checkpoint.memory_every=0: this start neither restores nor takes any"
    if memory_every and not resume:
        why = "checkpoint.resume=false: this start resumes from nothing"
    elif memory_every:
        snapshots.restore_into(checkpoints, cfg.checkpoint.verify)
        why = "the resume reads none of them again"
    snapshots.free(why)
    return snapshots if snapshots.taking else None


def start(run: ResolvedRun, guard: RunGuard, launch: launch_env.LaunchEnvironment | None = None) -> Trainer:
    """Steps 3-8, collective: the `Trainer` of ``run``, its resumed state loaded. ``launch``: what `apply_launch`
    returned (None: a launcher that wrote torch's variables itself, read again here)."""
    cfg = run.cfg
    place = ranks.join(launch, run.device_type)  # 3. the ranks
    if place.world_size != run.world_size:  # a launcher that wrote torch's variables itself, against its own
        raise ValueError(
            f"the process group has {place.world_size} ranks, the launcher's variables said {run.world_size}: the "
            f"batch split was resolved for {run.world_size}"
        )
    start_memory_history(cfg.profile, place.device)  # before the engine's allocations, which it records
    guard.connect(place.rank, place.world_size, cfg.train.stall_timeout)
    # The per-step stop-flag agreement goes over a CPU (gloo) group on accelerators, so that reading the flag
    # does not wait for the device to finish the step's kernels.
    flag_group = dist.new_group(backend="gloo") if place.device.type != "cpu" else None

    run_dir = RunDirectory.take(cfg.train.output_dir, place.rank, place.world_size, guard)  # 4. the run directory
    checkpoints = CheckpointManager(run_dir.checkpoints, place.rank, place.world_size, cfg.checkpoint.keep_last)
    guard.on_abort(checkpoints.abandon_save)  # a failed run leaves no save in flight behind
    checkpoints.remove_unfinished()
    if place.rank == 0:
        run_dir.keep_tokenizer(
            run.manifest.tokenizer.fingerprint,
            [cfg.data.tokenizer, run.manifest.build.get("tokenizer_directory")],
        )
    dist.barrier()

    snapshots = restore_snapshots(cfg, place, run_dir, checkpoints)  # 5. the resume plan: a newer snapshot first
    resume_plan = checkpoints.plan_resume(
        resume=cfg.checkpoint.resume,
        verify=cfg.checkpoint.verify,
        architecture=cfg.model.architecture(),
        zero_stage=cfg.zero.stage,
    )

    init_record, initial_weights = start_from(
        run.init_source, run.open_source, run.init_warning, cfg.train.output_dir, place, resume_plan
    )
    engine = build_engine(run, place, checkpoints, initial_weights)  # 6. the engine

    streams = TrainStreams(  # 7. the streams
        cfg.data.shards,
        cfg.data.train_split,
        tgt_len=cfg.model.tgt_len,
        micro_batch=run.batch_split.micro_batch,
        grad_accum=run.batch_split.grad_accum,
        world_size=place.world_size,
        rank=place.rank,
        seed=cfg.train.seed,
        shuffle_blocks=cfg.data.shuffle_blocks,
        expected_fingerprint=run.tokenizer_fingerprint,
        verify_sha256=cfg.data.verify_sha256,
        manifest=run.manifest,
    )
    state = resumed_state(run, place, guard, checkpoints, engine, streams, resume_plan)  # 8. the state
    parts = RunParts(
        place=place,
        guard=guard,
        flag_group=flag_group,
        run_dir=run_dir,
        checkpoints=checkpoints,
        snapshots=snapshots,
        engine=engine,
        state=state,
        resumed_from=resume_plan.tag if resume_plan is not None else None,
        init_from=init_record.summary() if init_record is not None else None,
    )
    return Trainer(run, parts)


def train(run: ResolvedRun, guard: RunGuard, launch: launch_env.LaunchEnvironment | None = None) -> dict[str, Any]:
    """Steps 3-8, then the run, then the process group left; the run's summary. A failure propagates: the caller
    hands it to ``guard.fail``, which ends every rank."""
    summary = start(run, guard, launch).run()
    # Every rank done before any tears gloo down: rank 1 of a 2-rank run aborted once at exit ("terminate called
    # without an active exception") after a finished run.
    dist.barrier()
    dist.destroy_process_group()  # one left to interpreter shutdown can abort the process at exit
    return summary


def run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, guard: RunGuard, open_source: OpenSource | None = None
) -> int:
    """The whole sequence for `launchers/train.py`: steps 1-8 and the run; 0 when it ends (a stop request
    included), 2 for a refused command line or launch (a SystemExit from `resolve`, or returned), 1 for an output
    folder the surroundings refuse (`resolve`). A failure on any rank ends every rank through ``guard``."""
    try:
        # exits 2 with the offending key before any process group exists
        resolved = resolve(parser, args, open_source=open_source)
    except BaseException:
        # Nothing started: give the caller (a test calling main in-process) its own signal handlers back and stop
        # the guard's watch thread.
        guard.close()
        raise
    guard.fault_log = fault_log(resolved.cfg.train.output_dir)  # the folder exists and takes files (step 1)
    try:
        launch = apply_launch(resolved.launch, resolved.launch_error)
    except ValueError as error:  # a launch whose processes cannot form one world: nothing has started
        guard.close()
        print_error(PROG, error)
        return USAGE_ERROR
    configure_logging(launch.rank)
    try:
        summary = train(resolved, guard, launch)
    except BaseException as error:  # noqa: BLE001 -- every failure ends every rank, with one message
        guard.fail(error)
    if launch.rank == 0:
        try:
            print(f"output: {summary['output_dir']}  (tensorboard --logdir {summary['output_dir']}/tensorboard)")
        except OSError:  # the launcher that read our output is gone
            pass
    return 0
