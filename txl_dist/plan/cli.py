"""`python -m txl_dist.plan`: the memory planner's command line and its memory sizes ("80GiB")."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from txl_dist.config import RunConfig, load_config, with_manifest_vocab
from txl_dist.data.format import MANIFEST_NAME, read_manifest
from txl_dist.data.run_vocab import with_shards_vocab
from txl_dist.exit_status import VERDICT, refuse
from txl_dist.rendezvous.launch_formats import read_hostfile

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "KI": 1024,
    "MI": 1024**2,
    "GI": 1024**3,
    "TI": 1024**4,
}


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '24G', '1.5TiB' -> bytes (GiB = 2^30, GB = 10^9)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a memory size such as 80GiB, 80GB or 24G")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


def main(argv: Sequence[str] | None = None) -> int:
    """The planner's command line; the help text is the package docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m txl_dist.plan",
        description=sys.modules[__package__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        required=True,
        metavar="PATH",
        help="run config (repeat to layer files, as for launchers/train.py)",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    ranks = parser.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--world-size", type=int, help="ranks (GPUs) of the run")
    ranks.add_argument(
        "--hostfile",
        metavar="PATH",
        help="the DeepSpeed hostfile of the run (`HOST slots=N` lines): its slots summed are the world size",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_size,
        help="memory per rank, e.g. 80GiB (for CPU ranks: the machine's memory / its ranks)",
    )
    parser.add_argument("--micro-batch", type=int, help="plan this micro-batch instead of the config's")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="model.n_token when no data.shards is given (default: the preset's); with data.shards it must "
        "agree with the manifest's vocabulary",
    )
    args = parser.parse_args(argv)
    try:
        if args.hostfile is not None:
            args.world_size = sum(read_hostfile(args.hostfile).values())
        if args.world_size < 1:
            raise ValueError(f"--world-size {args.world_size}: must be at least 1")
        if args.micro_batch is not None and args.micro_batch < 1:
            raise ValueError(f"--micro-batch {args.micro_batch}: must be at least 1")
        cfg = load_config(args.config, args.overrides)
        if args.micro_batch is not None and cfg.train.global_batch % args.micro_batch:
            raise ValueError(
                f"--micro-batch {args.micro_batch} with train.global_batch={cfg.train.global_batch}: no world "
                f"size can hold it: {cfg.train.micro_batch_problem(args.micro_batch)}"
            )
        cfg = _with_vocabulary(cfg, args.vocab_size)
        # lazy: --help stays under 1 s (the planner builds the model on the meta device: torch, 2-4 s)
        from txl_dist.plan.report import describe_with_fit

        text, fits = describe_with_fit(cfg, args.world_size, args.device, args.device_memory, args.micro_batch)
    except ValueError as error:
        refuse(parser.prog, error)  # one line, without argparse's usage: the flags were fine, a value is not
    print(text)
    # A job script tests the status: VERDICT (3) when the planned layout does not fit (the text names one that does,
    # if any), a status of its own, apart from a refused input (2) and a failure (1).
    return VERDICT if fits is False else 0


def _with_vocabulary(cfg: RunConfig, vocab_size: int | None) -> RunConfig:
    """``cfg`` with model.n_token from the manifest of data.shards when it is set (as the trainer: a data.shards
    without a manifest, or a ``--vocab-size`` that disagrees with it, is refused), else from ``--vocab-size``."""
    if cfg.data.shards is None:
        return cfg if vocab_size is None else with_manifest_vocab(cfg, vocab_size, "--vocab-size")
    manifest = read_manifest(cfg.data.shards)
    manifest_vocab = manifest.tokenizer.vocab_size
    if vocab_size is not None and vocab_size != manifest_vocab:
        raise ValueError(
            f"--vocab-size {vocab_size} disagrees with the manifest "
            f"{os.path.join(cfg.data.shards, MANIFEST_NAME)}: vocab_size {manifest_vocab}; leave --vocab-size out "
            f"to take it from the manifest"
        )
    return with_shards_vocab(cfg, manifest)
