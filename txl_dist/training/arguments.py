"""The training launcher's command line, parsed without torch or DeepSpeed: ``launchers/train.py --help`` answers
at once, and a refused flag costs no import of either (`txl_dist.training.startup` then checks the values).

DeepSpeed's flags (what ``deepspeed.add_config_arguments`` adds: --deepspeed, --deepspeed_config and the
deprecated --deepscale spellings) are declared here with DeepSpeed's names, types and defaults (the help in our
words), so that DeepSpeedExamples-style command lines work unchanged; `tests/test_config.py` holds them equal to
DeepSpeed's.
"""

from __future__ import annotations

import argparse

EPILOG = """\
Everything is checked before any process group exists, so that a bad value fails on every rank at once with one
line naming the key, not after minutes of start-up::

    deepspeed --num_gpus 8 launchers/train.py --config configs/lm1b_base.yaml \\
        data.shards=/data/lm1b/shards train.output_dir=runs/lm1b_base
    python launchers/train.py --config configs/tiny_cpu.yaml --config configs/variants/zero3.yaml --print-config

``--config`` may be repeated: files are layered left to right, then the overrides are applied (see
`txl_dist.config`). The world size is the launcher's (`txl_dist.rendezvous.launch_env`: torchrun, deepspeed, srun,
mpirun; 1 for a plain ``python`` run), the device from DeepSpeed's accelerator (DS_ACCELERATOR=cpu forces the CPU).
"""


def build_arg_parser() -> argparse.ArgumentParser:
    """The launcher's parser: --config (repeatable), key.path=value overrides, --print-config, --local_rank and
    DeepSpeed's --deepspeed / --deepspeed_config."""
    parser = argparse.ArgumentParser(
        prog="launchers/train.py",
        description="Train a Transformer-XL language model with DeepSpeed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="PATH",
        help="YAML run config; repeat to layer files left to right (e.g. a configs/variants/ file)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="override one config value, read as YAML (train.max_steps=100, model.d_embed=null)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML, and its memory plan per rank as comments, and exit",
    )
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="passed by DeepSpeed's launcher; ignored (the LOCAL_RANK environment variable is used)",
    )
    add_deepspeed_arguments(parser)
    return parser


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``deepspeed.add_config_arguments``, in a group of the same name. --deepspeed is accepted for
    DeepSpeedExamples-style command lines (training always uses DeepSpeed); --deepspeed_config names a JSON overlay
    for `txl_dist.training.deepspeed_config.build_deepspeed_config`; --deepscale_config is refused by
    `txl_dist.training.startup` with the name to use instead."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="accepted as DeepSpeed's scripts pass it; training always runs under DeepSpeed",
    )
    group.add_argument(
        "--deepspeed_config",
        default=None,
        type=str,
        help="a JSON file of DeepSpeed settings laid over the ones built from the run config",
    )
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="DeepSpeed's old spelling of --deepspeed; accepted",
    )
    group.add_argument(
        "--deepscale_config",
        default=None,
        type=str,
        help="DeepSpeed's old spelling of --deepspeed_config; refused, naming --deepspeed_config",
    )
    return parser
