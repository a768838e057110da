"""The training launcher's work once its command line is parsed (`txl_dist.training.arguments`): the run config
checked whole before any process group exists, then the run.

Every rank checks the config files, the ``key.path=value`` overrides, the batch layout for the launcher's world,
the ``--deepspeed_config`` overlay, the shards and the run directory (`resolve_run_config`), so that a bad value
fails on every rank at once with one line naming the key, not after minutes of start-up; `train` then runs the
`Trainer` and leaves the process group. `parse_run_args` does both steps of the command line for callers that
start from an argv (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from txl_dist.checkpoints.verify import preflight
from txl_dist.config import RunConfig, load_config
from txl_dist.data.format import MANIFEST_NAME, Manifest
from txl_dist.data.run_vocab import shards_manifest, with_shards_vocab
from txl_dist.exit_status import FAILURE, USAGE_ERROR, CommandFailure, os_error_status, print_error
from txl_dist.fileio import dangling_link, describe_os_error
from txl_dist.plan.counts import GiB
from txl_dist.plan.memory import largest_micro_batch, plan_memory
from txl_dist.plan.report import device_memory_of, plan_comment
from txl_dist.run_layout import CHECKPOINTS, PROFILE, TENSORBOARD, checkpoints_dir
from txl_dist.tokenizer import load_tokenizer
from txl_dist.training.arguments import build_arg_parser
from txl_dist.training.deepspeed_config import build_deepspeed_config
from txl_dist.training.trainer import Trainer
from txl_dist.world import launch_env
from txl_dist.world.guard import RunGuard


def detect_device() -> str:
    """DeepSpeed's accelerator: "cuda", "cpu", ..."""
    return get_accelerator().device_name()


def parse_run_args(
    argv: Sequence[str] | None = None, *, world_size: int | None = None, device: str | None = None
) -> tuple[RunConfig, argparse.Namespace]:
    """Parse the command line into a validated RunConfig (and the parsed flags): `resolve_run_config` of
    `build_arg_parser`'s parse of ``argv``."""
    parser = build_arg_parser()
    args = parser.parse_intermixed_args(argv)
    return resolve_run_config(parser, args, world_size=world_size, device=device), args


def resolve_run_config(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    world_size: int | None = None,
    device: str | None = None,
) -> RunConfig:
    """The validated RunConfig of the parsed command line ``args`` (errors are refused as ``parser.prog``).

    Checks the whole tree, the batch layout for ``world_size`` ranks (default: the launcher's world, else 1) on
    ``device`` (default: `detect_device`), the ``--deepspeed_config`` overlay, and, when data.shards is a local
    directory, takes model.n_token from its manifest. With --print-config it prints the resolved config and its
    memory plan (`txl_dist.plan`, as YAML comments) and exits 0. Any error exits 2 with one line on stderr naming
    the key, its value and what is allowed; a train.output_dir that the surroundings refuse to write (read-only,
    no space, not permitted) exits 1 with one line.

    Hand DeepSpeed the dict, not ``args``: ``deepspeed.initialize(config=build_deepspeed_config(...,
    overlay_path=args.deepspeed_config), ...)``; DeepSpeed refuses a config given both ways."""
    if world_size is None:
        launch = _launch()
        world_size = launch.world_size if launch is not None else 1
    try:
        if args.deepscale_config is not None:
            raise ValueError("--deepscale_config is DeepSpeed's deprecated spelling; use --deepspeed_config")
        cfg = load_config(args.config, args.overrides)
        manifest = shards_manifest(cfg)  # read once, here: the Trainer is handed what it resolves
        cfg = with_shards_vocab(cfg, manifest)
        device = device or detect_device()
        build_deepspeed_config(
            train=cfg.train,
            optim=cfg.optim,
            precision=cfg.precision,
            zero=cfg.zero,
            world_size=world_size,
            device=device,
            overlay_path=args.deepspeed_config,
        )
        if args.print_config:
            sys.stdout.write(cfg.dump_yaml() + plan_comment(cfg, world_size, device, device_memory_of(device)))
            sys.stdout.flush()
            raise SystemExit(0)
        _require_run_paths(cfg, manifest)
        _require_a_run_that_can_start(cfg, manifest)
        if device != "cpu":  # this rank's own device: no rank touches another's before the process group
            require_memory_fits(cfg, world_size, device, device_memory_of(device, _local_rank(args) or 0))
    except (ValueError, CommandFailure) as error:
        # A refused value exits 2; an output the surroundings refuse (read-only, no space) is a failure, 1.
        status = USAGE_ERROR if isinstance(error, ValueError) else FAILURE
        if _local_rank(args) in (None, 0):  # every rank found the same: the node's first rank says it once
            print_error(parser.prog, error)  # one line, without argparse's usage: the flags were fine, a value is not
        raise SystemExit(status) from None
    return cfg


def train(cfg: RunConfig, args: argparse.Namespace, guard: RunGuard) -> dict[str, Any]:
    """Run the `Trainer` on ``cfg`` (the launch environment applied), then leave the process group; the run's
    summary. A failure propagates: the launcher hands it to ``guard.fail``, which ends every rank."""
    summary = Trainer(cfg, deepspeed_overlay=args.deepspeed_config, guard=guard).run()
    # Every rank done before any tears gloo down: rank 1 of a 2-rank run aborted once at exit ("terminate called
    # without an active exception") after a finished run.
    dist.barrier()
    dist.destroy_process_group()  # one left to interpreter shutdown can abort the process at exit
    return summary


def _local_rank(args: argparse.Namespace) -> int | None:
    """This process's rank on its node, as whichever launcher started it says (None: no launcher). Only the
    node's first rank prints a configuration error, which is the same on every rank of a node: once per node, not
    once per rank (each node still prints its own, since a node may see other files than the rest)."""
    launch = _launch()
    if launch is not None and launch.launcher != "single":
        return launch.local_rank
    local = os.environ.get("LOCAL_RANK", "")
    return int(local) if local.isdigit() else args.local_rank


def _launch():
    """The launch this process is part of (`txl_dist.world.launch_env`: torchrun, deepspeed, srun, mpirun), None when
    its variables do not make one (train.py says why once the arguments are accepted)."""
    try:
        return launch_env.resolve(os.environ)
    except launch_env.LaunchError:
        return None


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
    _require_writable_directory(output_dir)


def _require_writable_directory(output_dir: Path) -> None:
    """train.output_dir, or the folder it will be made in, accepts a new file (probed: permissions alone do not
    tell a read-only mount or a root-squashed NFS export)."""
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        target = dangling_link(existing)
        if target is not None:  # mkdir would fail on it with "File exists"
            raise ValueError(
                f"train.output_dir={str(output_dir)!r}: {existing} is a symbolic link to {target}, which leads "
                f"nowhere: create its target or remove the link"
            )
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"train.output_dir={str(output_dir)!r}: {existing} is a file, not a directory")
    # The folders the run writes into later (its checkpoints hours from now) are probed too, where they exist.
    written_later = [output_dir / name for name in (CHECKPOINTS, TENSORBOARD, PROFILE)]
    for folder in [existing, *(path for path in written_later if path.is_dir())]:
        try:
            handle, probe = tempfile.mkstemp(prefix=".txl_dist-write-probe.", dir=folder)
            os.close(handle)
            os.unlink(probe)
        except OSError as error:
            message = f"train.output_dir={str(output_dir)!r}: cannot write in {describe_os_error(error, folder)}"
            raise (ValueError if os_error_status(error) == USAGE_ERROR else CommandFailure)(message) from None


def require_memory_fits(cfg: RunConfig, world_size: int, device: str, device_memory: int | None) -> None:
    """ValueError when the memory plan of a rank (`txl_dist.plan`) needs more than ``device_memory``, naming the
    layout that fits; nothing with train.memory_check=false or an unknown device size."""
    if device_memory is None or not cfg.train.memory_check:
        return
    plan = plan_memory(cfg, world_size, None, device)
    if plan.needed() <= device_memory:
        return
    fit = largest_micro_batch(cfg, world_size, device_memory, device)
    if fit.micro_batch is not None:
        advice = f"train.micro_batch={fit.micro_batch} ({fit.grad_accum} accumulation steps) fits"
    else:
        advice = "no micro-batch fits: use a higher ZeRO stage, optimizer offload or more ranks"
    raise ValueError(
        f"micro-batch {plan.micro_batch}: the memory plan needs {plan.needed() / GiB:.2f} GiB per "
        f"rank, the {device} device has {device_memory / GiB:.2f} GiB; {advice} (python -m txl_dist.plan "
        f"shows the plan; train.memory_check=false starts anyway)"
    )


def _require_a_run_that_can_start(cfg: RunConfig, manifest: Manifest) -> None:
    """What the trainer would refuse only after every rank has started, found here from the files alone: a
    data.tokenizer other than the one the shards were built with, checkpoints in train.output_dir under
    checkpoint.resume=false, and a newest complete checkpoint of another architecture (`checkpoints.verify.preflight`:
    the rules of `refuse_to_start`, which the trainer applies to the checkpoint it resumes from once verified)."""
    if cfg.data.tokenizer is not None:
        expected = manifest.tokenizer.fingerprint
        try:
            found = load_tokenizer(cfg.data.tokenizer).fingerprint  # the whole check (the trainer then hashes only)
        except ValueError as error:
            raise ValueError(f"data.tokenizer={cfg.data.tokenizer!r}: {error}") from error
        if found != expected:
            raise ValueError(
                f"data.tokenizer={cfg.data.tokenizer!r}: its fingerprint {found} differs from "
                f"{Path(cfg.data.shards, MANIFEST_NAME)}'s {expected}: the shards were built with another "
                f"tokenizer"
            )
    preflight(
        checkpoints_dir(cfg.train.output_dir), resume=cfg.checkpoint.resume, architecture=cfg.model.architecture()
    )
