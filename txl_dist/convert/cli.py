"""The subcommands of ``launchers/convert.py`` once its command line is parsed and its output checked: a
training checkpoint to an export folder, an export folder to HuggingFace TransfoXL, current transformers or the
authors' state dict, and back (see the launcher's docstring for the command lines). Each returns the line that
the launcher prints.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from txl_dist.convert.hf import read_hf_folder, write_hf_folder
from txl_dist.convert.hub import write_hub_folder
from txl_dist.convert.original import from_original_state_dict, load_original, save_original, to_original_state_dict
from txl_dist.convert.tf_release import write_release_export
from txl_dist.convert.tf_release_folder import SETTING_NAMES
from txl_dist.convert.zero import consolidate_weights, find_tokenizer, read_training_checkpoint
from txl_dist.export import load_model, read_config_file, write_export


def zero_to_export(args: argparse.Namespace) -> str:
    _warn_unverified(args, args.checkpoint, "COMPLETE.json")
    checkpoint = read_training_checkpoint(args.checkpoint, verify=not args.no_verify)
    tokenizer_dir = find_tokenizer(checkpoint, args.tokenizer)
    weights = consolidate_weights(checkpoint)
    client = checkpoint.client
    training_info = {
        "source": str(checkpoint.tag_dir.resolve()),
        "step": client["step"],
        "tokens_seen": client["tokens_seen"],
        "best_eval": client.get("best"),
        "world_size": client.get("world_size"),
        "data": {"shards": checkpoint.run_config.data.shards, "train_split": checkpoint.run_config.data.train_split},
        "run_config": client["config"],
    }
    out = write_export(
        weights,
        checkpoint.run_config.model,
        args.output,
        tokenizer_dir=tokenizer_dir,
        tokenizer_identity=client["tokenizer"],
        training_info=training_info,
        overwrite=args.overwrite,
    )
    return f"{checkpoint.tag_dir} (step {client['step']}) -> {out}"


def _warn_unverified(args: argparse.Namespace, source: str, listing: str) -> None:
    """Under --no-verify, the warning that ``source`` is read without checking its files against ``listing``."""
    if args.no_verify:
        print(
            f"convert.py {args.command}: warning: --no-verify: {source} is read without checking its files "
            f"against {listing}",
            file=sys.stderr,
        )


def _warn_unverified_export(args: argparse.Namespace) -> None:
    _warn_unverified(args, args.export, "checksums.json")


def export_to_hf(args: argparse.Namespace) -> str:
    _warn_unverified_export(args)
    out = write_hf_folder(args.export, args.output, overwrite=args.overwrite, verify=not args.no_verify)
    return f"{args.export} -> {out} (transformers 4.37.2: TransfoXLLMHeadModel.from_pretrained({str(out)!r}))"


def export_to_hub(args: argparse.Namespace) -> str:
    _warn_unverified_export(args)
    out = write_hub_folder(args.export, args.output, overwrite=args.overwrite, verify=not args.no_verify)
    return (
        f"{args.export} -> {out} (transformers 5: AutoModelForCausalLM.from_pretrained({str(out)!r}, "
        f"trust_remote_code=True), AutoTokenizer.from_pretrained({str(out)!r}))"
    )


def hf_to_export(args: argparse.Namespace) -> str:
    config, state, identity, tokenizer_dir = read_hf_folder(args.hf)
    out = write_export(
        state,
        config,
        args.output,
        tokenizer_dir=tokenizer_dir,
        tokenizer_identity=identity,
        training_info={"source": str(Path(args.hf).resolve()), "converted_from": "huggingface"},
        overwrite=args.overwrite,
    )
    return f"{args.hf} -> {out}"


def export_to_original(args: argparse.Namespace) -> str:
    _warn_unverified_export(args)
    model = load_model(args.export, verify=not args.no_verify)
    out = Path(args.output)
    save_original(to_original_state_dict(model.state_dict(), model.config), out)
    return f"{args.export} -> {out} (a state dict; the matching arguments are in {Path(args.export) / 'config.json'})"


def original_to_export(args: argparse.Namespace) -> str:
    config, identity = read_config_file(args.config)
    state = from_original_state_dict(load_original(args.original), config)
    out = write_export(
        state,
        config,
        args.output,
        tokenizer_dir=args.tokenizer,
        tokenizer_identity=identity,
        training_info={"source": str(Path(args.original).resolve()), "converted_from": "original"},
        overwrite=args.overwrite,
    )
    return f"{args.original} -> {out}"


def tf_to_export(args: argparse.Namespace) -> str:
    settings = {name: getattr(args, name) for name in SETTING_NAMES}
    out, opened = write_release_export(
        args.release, args.output, checkpoint=args.checkpoint, settings=settings, overwrite=args.overwrite
    )
    config = opened.config
    return (
        f"{opened.release.prefix} ({opened.dataset}: {config.n_layer} layers, d_model {config.d_model}, "
        f"{config.n_token:,} tokens) -> {out}"
    )


COMMANDS: dict[str, Callable[[argparse.Namespace], str]] = {
    "zero-to-export": zero_to_export,
    "export-to-hf": export_to_hf,
    "export-to-hub": export_to_hub,
    "hf-to-export": hf_to_export,
    "export-to-original": export_to_original,
    "original-to-export": original_to_export,
    "tf-to-export": tf_to_export,
}
"""Each subcommand of launchers/convert.py by name: its function of the parsed arguments."""


def run(args: argparse.Namespace) -> str:
    """Run the subcommand ``args.command``; the line that says what it wrote."""
    return COMMANDS[args.command](args)
