"""Convert between training checkpoints, export folders, HuggingFace TransfoXL and the authors' PyTorch layout.

    # a DeepSpeed checkpoint (any ZeRO stage, any number of ranks; the run folder means its latest checkpoint)
    python launchers/convert.py zero-to-export runs/lm1b_base exports/lm1b_base
    python launchers/convert.py zero-to-export runs/lm1b_base/checkpoints/step00200000 exports/lm1b_base_200k

    # HuggingFace transformers 4.37.2: TransfoXLLMHeadModel.from_pretrained("hf/lm1b_base"), and back
    python launchers/convert.py export-to-hf exports/lm1b_base hf/lm1b_base
    python launchers/convert.py hf-to-export hf/lm1b_base exports/lm1b_base_from_hf

    # current transformers (5.x): AutoModelForCausalLM.from_pretrained("hub/lm1b_base", trust_remote_code=True)
    # and AutoTokenizer.from_pretrained("hub/lm1b_base"); generate() carries the memory as the cache
    python launchers/convert.py export-to-hub exports/lm1b_base hub/lm1b_base

    # the authors' released TensorFlow models (pretrained_xl/ of their tf/sota/download.sh); needs TensorFlow:
    # pip install 'txl_dist[tf]'
    python launchers/convert.py tf-to-export pretrained_xl/tf_wt103 exports/wt103_authors

    # the authors' state dict (their eval.py after model.load_state_dict), and back with a config.json
    python launchers/convert.py export-to-original exports/lm1b_base lm1b_base.pt
    python launchers/convert.py original-to-export model_state.pt exports/lm1b_base/config.json exports/from_original

An export folder holds config.json (the authors' argument names), model.safetensors, tokenizer/ and training.json;
`txl_dist.load_pretrained(EXPORT)`, launchers/evaluate.py and launchers/generate.py read it. A training checkpoint
is verified against its COMPLETE.json before it is read, an export folder against its checksums.json (--no-verify
skips that, and says so), and read weights-only: a crafted pickle is refused, not run; weights that hold NaN or
infinity are refused by name.

Outputs never destroy an input: an output that is an input, contains one or lies inside one is refused before any
work. Outputs are written under a temporary name and renamed when complete; an existing output is refused without
--overwrite, and --overwrite replaces only an empty folder or one that txl_dist wrote (it leaves a
.txl_dist-output file in each).
"""

from __future__ import annotations

import argparse
import sys

from txl_dist.exit_status import USAGE_ERROR, os_error_status, print_error, run_command
from txl_dist.fileio import describe_os_error
from txl_dist.output_folders import check_output_path
from txl_dist.supervision.interrupts import one_line_on_stop


def _add_command(
    commands, name: str, help_text: str, inputs: tuple[str, ...], output_is_file: bool = False
) -> argparse.ArgumentParser:
    """A subcommand (its work: `txl_dist.convert.cli.COMMANDS`); ``inputs`` names its arguments that are paths it
    reads (`guard_output` keeps the output away from them)."""
    sub = commands.add_parser(name, help=help_text, description=help_text)
    sub.set_defaults(inputs=inputs, output_is_file=output_is_file)
    sub.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output (only an empty folder or one txl_dist wrote)",
    )
    return sub


def _add_export_command(
    commands, name: str, help_text: str, output_help: str | None = None, output_is_file: bool = False
) -> None:
    """A subcommand that reads an export folder (and may skip its verification)."""
    sub = _add_command(commands, name, help_text, inputs=("export",), output_is_file=output_is_file)
    sub.add_argument("export")
    sub.add_argument("output", help=output_help)
    sub.add_argument(
        "--no-verify",
        action="store_true",
        help="read the export without checking its files against its checksums.json",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launchers/convert.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = _add_command(
        commands,
        "zero-to-export",
        "a DeepSpeed training checkpoint -> an export folder",
        inputs=("checkpoint", "tokenizer"),
    )
    sub.add_argument("checkpoint", help="run folder, its checkpoints/ folder, or one checkpoint folder")
    sub.add_argument("output", help="the export folder to write")
    sub.add_argument("--tokenizer", help="tokenizer folder (default: the one the run recorded, found by fingerprint)")
    sub.add_argument(
        "--no-verify",
        action="store_true",
        help="read the checkpoint without checking its files against its COMPLETE.json",
    )
    _add_export_command(commands, "export-to-hf", "an export folder -> a HuggingFace TransfoXL folder")
    _add_export_command(
        commands,
        "export-to-hub",
        "an export folder -> a folder for current transformers (remote code, fast tokenizer)",
    )
    sub = _add_command(commands, "hf-to-export", "a HuggingFace TransfoXL folder -> an export folder", inputs=("hf",))
    sub.add_argument("hf")
    sub.add_argument("output")
    _add_export_command(
        commands,
        "export-to-original",
        "an export folder -> the authors' state dict (.pt)",
        output_help="the .pt file to write",
        output_is_file=True,
    )
    sub = _add_command(
        commands,
        "tf-to-export",
        "the authors' released TensorFlow model (their tf/sota/download.sh) -> an export folder",
        inputs=("release",),
    )
    sub.add_argument("release", help="the folder of one model, holding model/ and data/ (e.g. pretrained_xl/tf_wt103)")
    sub.add_argument("output", help="the export folder to write")
    sub.add_argument("--checkpoint", help="the checkpoint prefix in model/ (default: the only one, or the latest)")
    sub.add_argument("--tgt-len", type=int, help="tokens per segment (default: their test setting)")
    sub.add_argument("--mem-len", type=int, help="memory length (default: their test setting)")
    sub.add_argument("--clamp-len", type=int, help="clamp relative distances (default: their test setting)")
    sub.add_argument(
        "--same-length", action=argparse.BooleanOptionalAction, default=None, help="(default: their test setting)"
    )
    sub.add_argument("--dropout", type=float, help="dropout for fine-tuning (default: their training's)")
    sub.add_argument("--dropatt", type=float, help="attention dropout for fine-tuning (default: their training's)")
    sub = _add_command(
        commands,
        "original-to-export",
        "the authors' state dict + a config.json of their argument names -> an export folder",
        inputs=("original", "config", "tokenizer"),
    )
    sub.add_argument("original", help="a state dict saved from the authors' MemTransformerLM (.pt)")
    sub.add_argument("config", help="config.json with the authors' argument names (n_token, n_layer, ...)")
    sub.add_argument("output")
    sub.add_argument("--tokenizer", help="tokenizer folder to include (its vocabulary must match n_token)")
    return parser


def guard_output(args: argparse.Namespace) -> None:
    """Before any work, for every subcommand: refuse an output that is, contains or lies inside one of its inputs,
    and an existing one unless --overwrite may replace it (`txl_dist.output_folders.check_output_path`)."""
    inputs = [getattr(args, name) for name in args.inputs if getattr(args, name, None) is not None]
    check_output_path(args.output, inputs, overwrite=args.overwrite, directory=not args.output_is_file)


# Every output is staged or written under a temporary name (txl_dist.output_folders, txl_dist.fileio), which an
# interrupt removes.
@one_line_on_stop("convert.py", "no output written (an existing one is left as it was)")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        guard_output(args)
        # lazy: --help and a refused output stay under 1 s (torch and DeepSpeed take seconds to import)
        from txl_dist.convert import cli

        print(cli.run(args))
    except OSError as error:  # a read-only or full output (1), a missing input (2): the path and the cause
        print_error(f"convert.py {args.command}", describe_os_error(error))
        return os_error_status(error)
    except (ValueError, KeyError) as error:
        print_error(f"convert.py {args.command}", error)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "convert.py"))
