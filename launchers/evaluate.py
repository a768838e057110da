"""Perplexity of a trained model on one split of its shards; every target token is scored exactly once.

    python launchers/evaluate.py exports/ptb_small --split test
    python launchers/evaluate.py runs/ptb_small --split test                 # the run's latest checkpoint
    python launchers/evaluate.py runs/lm1b_base/checkpoints/step00500000 --split test \\
        --tgt-len 32 --mem-len 128 --same-length --batch-size 64
    # across ranks (any launcher; each rank scores its own streams)
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 launchers/evaluate.py exports/ptb_small --split test
    torchrun --nproc_per_node 8 launchers/evaluate.py exports/lm1b_base --split test --shards /data/lm1b/shards
    # any text files, with the model's tokenizer, without building shards first (any model txl_dist reads)
    python launchers/evaluate.py exports/wt103_authors --text my_notes.txt --output my_notes.json
    python launchers/evaluate.py runs/finetuned --text held_out.txt --eval-settings
    # the run config's eval section: for configs/enwik8_large.yaml the paper's tgt_len 128, mem_len 3800,
    # clamp_len 1000 with same_length, reporting bits per character
    python launchers/evaluate.py runs/enwik8_large --split test --eval-settings

The model comes from an export folder or a DeepSpeed checkpoint (any ZeRO stage and number of ranks, gathered on the
CPU; verified against its COMPLETE.json first, unless --no-verify, and read weights-only). The shards default to the
ones the model was trained on. Prints a summary and writes JSON (--output; by default ``eval_{split}.json`` in an
export folder, ``eval_{split}_{tag}.json`` in a run folder): tokens scored, loss and, for a byte or char tokenizer,
bits per character (per byte: enwik8's bpc), for a word or subword tokenizer per-token and per-word perplexity
(words: the whitespace-separated units of the text, with each document separator counted as one; bits per
character too when every piece is one character). Ctrl-C or SIGTERM ends it with one line, writing nothing; a
rank whose launcher is gone (the deepspeed runner killed) stops as on SIGTERM.
"""

from __future__ import annotations

import argparse
import glob
import sys
import tempfile
from pathlib import Path

from txl_dist.exit_status import USAGE_ERROR, describe_error, print_error, run_command
from txl_dist.supervision.interrupts import one_line_on_stop, stop_this_process
from txl_dist.supervision.launcher_watch import watching_launcher


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launchers/evaluate.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        help="an export folder, a training run folder or one checkpoint folder; with --text also a transformers "
        "TransfoXL folder, a folder of export-to-hub, the authors' state dict or TensorFlow release",
    )
    parser.add_argument(
        "--text",
        nargs="+",
        metavar="FILE",
        help="score these plain text files (tokenised with the model's tokenizer, as build_shards would) "
        "instead of a split of shards",
    )
    parser.add_argument(
        "--doc-per",
        choices=("line", "blank-line", "file"),
        help="with --text: what one document of the files is (build_shards' --doc-per; default: line)",
    )
    parser.add_argument("--split", default="test", help="the split of the shards to score (default: test)")
    parser.add_argument("--shards", help="shard folder (default: the one the model was trained on)")
    parser.add_argument("--tgt-len", type=int, help="tokens per segment (default: the model's)")
    parser.add_argument("--mem-len", type=int, help="memory length (default: the model's)")
    parser.add_argument("--clamp-len", type=int, help="clamp relative distances (default: the model's)")
    parser.add_argument(
        "--same-length",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every query sees mem_len keys (default: the model's)",
    )
    parser.add_argument(
        "--eval-settings",
        action="store_true",
        help="take tgt_len, mem_len, clamp_len and same_length from the run config's eval section "
        "(the paper's evaluation for the shipped configs, e.g. enwik8_large's 128 / 3800 / 1000 "
        "with same_length); the flags above still win",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="streams over all ranks (default: 16)")
    parser.add_argument("--tokenizer", help="tokenizer folder, for a checkpoint whose own cannot be found")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="read a checkpoint or export without checking its files against its COMPLETE.json or checksums.json",
    )
    parser.add_argument("--output", help="where to write the JSON result")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


@one_line_on_stop("evaluate.py", "no result written")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A rank whose launcher is gone (the deepspeed runner killed, an ssh connection lost) stops, as on SIGTERM,
    # instead of computing on as an orphan.
    with watching_launcher(stop_this_process):
        # lazy: --help stays under 1 s (torch and DeepSpeed take seconds to import)
        from txl_dist.downstream.evaluate import evaluate_and_write, model_tokenizer

        if args.text:
            return _score_text(args, evaluate_and_write, model_tokenizer)
        if args.doc_per is not None:
            print_error("evaluate.py", "--doc-per: reads the files of --text; give --text FILE...")
            return USAGE_ERROR
        return evaluate_and_write(args)


def _score_text(args: argparse.Namespace, evaluate_and_write, model_tokenizer) -> int:
    """--text: the files made into shards of one split, in a folder of this process's own (each rank makes its
    own: the same shards, on any node), with the model's tokenizer; then scored as a split is."""
    # lazy: the shard builder, which only --text needs
    from data_tools import build_shards as builder

    if args.shards is not None or args.split != "test":
        print_error("evaluate.py", "--text scores the files given: --shards and --split do not apply")
        return USAGE_ERROR
    for name in args.text:
        if "," in name:
            print_error("evaluate.py", f"--text {name}: a comma in a file name is not read (rename the file)")
            return USAGE_ERROR
        if not Path(name).is_file():
            print_error("evaluate.py", f"--text {name}: no such file")
            return USAGE_ERROR
    try:
        with (
            model_tokenizer(args.model, args.tokenizer) as tokenizer_dir,
            tempfile.TemporaryDirectory(prefix="txl_dist-text-") as folder,
        ):
            shards = Path(folder) / "shards"
            flags = ["--tokenizer", str(tokenizer_dir), "--output", str(shards), "--no-progress", "--workers", "1"]
            flags += ["--split", "text=" + ",".join(glob.escape(str(Path(name).resolve())) for name in args.text)]
            flags += ["--doc-per", args.doc_per] if args.doc_per else []
            settings = builder.settings_from_args(builder.parse_args(flags))
            builder.build_shards(settings, shards, workers=1, resume=False, overwrite=False, progress=False)
            args.shards, args.split = str(shards), "text"
            return evaluate_and_write(args)
    except (ValueError, builder.InputError, builder.ManifestError) as error:
        print_error("evaluate.py", describe_error(error))
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(run_command(main, "evaluate.py"))
