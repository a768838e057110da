"""The work of ``launchers/generate.py`` once its command line is parsed: an export folder loaded (verified
against its checksums.json unless --no-verify), then a prompt continued token by token, printed as it is
generated, or texts scored (see the launcher's docstring for the command lines).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from txl_dist.exit_status import describe_error, exit_status, print_error
from txl_dist.export import load_pretrained, require_export_folder
from txl_dist.inference import TokenSampler, iter_generate, score


def generate_or_score(args: argparse.Namespace) -> int:
    """Continue ``args.prompt`` or score ``args.score`` with the export ``args.export``; the exit status: 0, 2 for a
    refused input, 1 for an OSError of the surroundings (each printed as one line)."""
    overrides = {"mem_len": args.mem_len} if args.mem_len is not None else {}
    try:
        if args.num_samples < 1:
            raise ValueError(f"--num-samples {args.num_samples}: must be at least 1")
        _require_device(args.device)
        # the sampling settings checked before the prompt is echoed, so that a refusal is a line of its own
        TokenSampler(torch.device("cpu"), temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        require_export_folder(args.export)  # a folder of something else is named, with no word of checksums
        if args.no_verify:
            print(
                f"generate.py: warning: --no-verify: {args.export} is read without checking its files against "
                f"checksums.json",
                file=sys.stderr,
            )
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
