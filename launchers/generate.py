"""Continue a prompt with a trained model, or score texts, from an export folder.

    python launchers/generate.py exports/ptb_small --prompt "the company said" --max-new-tokens 40 --seed 1
    python launchers/generate.py exports/ptb_small --prompt "the company said" --greedy
    python launchers/generate.py exports/lm1b_base --prompt "The" --top-p 0.9 --temperature 0.8 --mem-len 256
    python launchers/generate.py exports/ptb_small --score "the market fell" "fell the market"
    python launchers/generate.py exports/enwik8_base --prompt "[[Albert Einstein]] was" --max-new-tokens 200
    python launchers/generate.py exports/enwik8_base --score "The cat sat." "Cat the sat."   # bits per character

Decoding is incremental: after the prompt, one forward of one token per new token, each layer's keys and values
of the context (at most --mem-len positions, the model's by default) kept in a cache. Text is printed as it is
generated. Prompts and scored texts with unknown words get a warning: the unknown token is often likely, so such a
text can score better than real text. The export's files are checked against its checksums.json first
(--no-verify skips that, and says so).
"""

from __future__ import annotations

import argparse
import math
import sys

from txl_dist.exit_status import describe_error, exit_status, print_error, run_command
from txl_dist.world.interrupts import one_line_on_stop


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launchers/generate.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("export", help="an export folder (launchers/convert.py zero-to-export)")
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--prompt", help="text to continue")
    task.add_argument("--score", nargs="+", metavar="TEXT", help="texts to score (log-probability, perplexity)")
    parser.add_argument("--max-new-tokens", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    parser.add_argument("--greedy", action="store_true", help="always the most probable token")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--mem-len", type=int, help="memory length (default: the model's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--no-verify", action="store_true", help="read the export without checking its files against its checksums.json"
    )
    return parser


@one_line_on_stop("generate.py", "what it generated or scored before is printed above")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    # lazy: --help stays under 1 s (torch/DeepSpeed)
    from txl_dist.export import load_pretrained

    overrides = {"mem_len": args.mem_len} if args.mem_len is not None else {}
    if args.no_verify:
        print(
            f"generate.py: warning: --no-verify: {args.export} is read without checking its files against "
            f"checksums.json",
            file=sys.stderr,
        )
    try:
        if args.num_samples < 1:
            raise ValueError(f"--num-samples {args.num_samples}: must be at least 1")
        _require_device(args.device)
        model, tokenizer = load_pretrained(args.export, device=args.device, verify=not args.no_verify, **overrides)
        if tokenizer is None:
            raise ValueError(f"{args.export} has no tokenizer: text cannot be encoded (see convert.py --tokenizer)")
        if args.prompt is not None:
            _warn_unknown_prompt(tokenizer, args.prompt)
        if args.score:
            _print_scores(model, tokenizer, args.score)
        else:
            _print_samples(model, tokenizer, args)
    except (ValueError, OSError) as error:  # 2 for a refused input; 1 for an OSError of the surroundings
        print_error("generate.py", describe_error(error))
        return exit_status(error)
    return 0


def _print_scores(model, tokenizer, texts: list[str]) -> None:
    # lazy: --help stays under 1 s (torch/DeepSpeed)
    from txl_dist.inference import score

    for text, result in zip(texts, score(model, tokenizer, texts)):
        if getattr(tokenizer, "character_level", False):  # bits per character (per byte for bytes)
            bpc = -result["logprob"] / math.log(2) / result["tokens"]
            print(f"{result['logprob']:10.3f} nats  {result['tokens']:4d} characters  {bpc:7.4f} bpc  {text}")
            continue
        print(f"{result['logprob']:10.3f} nats  {result['tokens']:4d} tokens  ppl {result['ppl']:9.2f}  {text}")
        if result["unknown"]:
            print(
                f"generate.py: warning: {result['unknown']} of the {result['tokens'] - 1} tokens of {text!r} "
                f"are the unknown token: its perplexity is not comparable with that of known text",
                file=sys.stderr,
            )


def _print_samples(model, tokenizer, args: argparse.Namespace) -> None:
    """--num-samples continuations of the prompt, printed as they are generated."""
    # lazy: --help stays under 1 s (torch/DeepSpeed)
    from txl_dist.inference import iter_generate

    for sample in range(args.num_samples):
        seed = None if args.seed is None else args.seed + sample
        print(args.prompt, end="", flush=True)
        pieces = iter_generate(
            model,
            tokenizer,
            args.prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=seed,
            greedy=args.greedy,
        )
        for index, piece in enumerate(pieces):
            if index == 0 and not piece.startswith((" ", "\n")) and not getattr(tokenizer, "character_level", False):
                piece = " " + piece
            print(piece, end="", flush=True)
        print(flush=True)


def _require_device(name: str) -> None:
    """ValueError naming ``--device`` when it is no device of this machine (torch would fail deep in a copy)."""
    # lazy: --help stays under 1 s (torch/DeepSpeed)
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r}: not a device name ({error}); use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: no CUDA device is available on this machine (torch "
                f"{torch.__version__}, torch.cuda.is_available() is False); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--device {name!r}: only cpu and cuda are supported")


def _warn_unknown_prompt(tokenizer, prompt: str) -> None:
    """A prompt whose tokens are all, or partly, the unknown token conditions the model on little or nothing."""
    unk = getattr(tokenizer, "unk_id", None)
    ids = tokenizer.encode(prompt)
    unknown = sum(token == unk for token in ids) if unk is not None else 0
    if unknown:
        print(
            f"generate.py: warning: {unknown} of the {len(ids)} tokens of the prompt {prompt!r} are the unknown "
            f"token: the model continues from {'nothing it knows' if unknown == len(ids) else 'a partial context'}",
            file=sys.stderr,
        )


if __name__ == "__main__":
    sys.exit(run_command(main, "generate.py"))
