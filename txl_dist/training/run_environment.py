"""What a run is, as its start reports it: the environment it runs in (versions, world, launcher, hosts, restarts,
the code's commit), and the entries TensorBoard shows of it (`texts`: the Text tab's config, environment and model;
`hparams`: the HParams dashboard's hyperparameters). Computed from facts resolved once (the launch, the ranks' host
names); `txl_dist.training.step_log.log_start` writes them at every start.

The tags are stable (`TEXT_TAGS`), so that a run's starts line up as entries of one tag, each at the step it
started from.
"""

from __future__ import annotations

import collections
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from txl_dist.config import RunConfig

TEXT_TAGS = ("run/config", "run/environment", "run/model")

RESTART_VARIABLES = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
"""What Slurm (a requeued job) and torchrun's elastic agent count; the run's own starts come from metrics.jsonl."""


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


def versions() -> dict[str, str]:
    """Python, torch, DeepSpeed, the accelerator; on a GPU its name and the CUDA and NCCL versions."""
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


def environment(world_size: int, hosts: Sequence[str], launcher: str, earlier_starts: int) -> dict[str, str]:
    """The environment entry's rows: versions, world, ``launcher`` (`LaunchEnvironment.name`), ``hosts`` (every
    rank's, gathered at the rendezvous: `txl_dist.rendezvous.ranks.Place`), restarts, commit."""
    per_host = collections.Counter(hosts)
    restarts = {key: os.environ[key] for key in RESTART_VARIABLES if key in os.environ}
    rows = {
        **versions(),
        "world size": str(world_size),
        "ranks per node": ", ".join(f"{count} on {host}" for host, count in per_host.items()),
        "launcher": launcher,
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
