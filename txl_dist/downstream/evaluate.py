"""The work of ``launchers/evaluate.py`` once its command line is parsed: the model from an export folder or a
DeepSpeed checkpoint (verified once, gathered on rank 0 and broadcast), the split scored across the ranks of
whichever launcher started them, and the result written as JSON (see the launcher's docstring for the command
lines and what is reported).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from txl_dist.convert.sources import open_source
from txl_dist.convert.zero import (
    CheckpointError,
    consolidate_weights,
    find_tokenizer,
    locate_checkpoint,
    read_training_checkpoint,
    require_verified,
)
from txl_dist.data import EvalStreams, read_manifest
from txl_dist.evaluation import evaluate, perplexity
from txl_dist.exit_status import describe_error, exit_status, os_error_status, print_error
from txl_dist.export import (
    CONFIG_FILE,
    TRAINING_FILE,
    WEIGHTS_FILE,
    apply_eval_overrides,
    load_export_tokenizer,
    load_model,
    model_from_state_dict,
)
from txl_dist.fileio import atomic_write_text, dangling_link, describe_os_error, read_json
from txl_dist.rendezvous import launch_env, ranks
from txl_dist.tokenizer import CHARACTER_KINDS, load_tokenizer


def _distributed() -> tuple[int, int, Any]:
    """(rank, world size, device); a process group, as the trainer's, when a launcher started several processes."""
    # torchrun, deepspeed, srun or mpirun: the same world whichever started the ranks.
    if launch_env.resolve(os.environ).world_size > 1:
        launch_env.apply()
        place = ranks.join()
        return place.rank, place.world_size, place.device
    return 0, 1, ranks.local_device()


class _SharedError(ValueError):
    """An error every rank raises alike (rank 0 found it and told the others): printed by rank 0 only."""


def _verify_once(path: Path, verify: bool) -> None:
    """Rank 0 verifies the checkpoint and tells the other ranks (each reading every file would multiply the
    reads); all raise the same error."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = None
    if rank == 0:
        try:
            tag_dir = locate_checkpoint(path)
            if verify:
                require_verified(tag_dir)
            else:
                print(
                    f"evaluate.py: warning: --no-verify: {tag_dir} is read without checking its files against "
                    f"COMPLETE.json",
                    file=sys.stderr,
                )
        except CheckpointError as error:
            problem = str(error)
    if dist.is_initialized():
        problem = ranks.broadcast(problem)
    if problem is not None:
        raise _SharedError(problem)


def _with_eval_section(overrides: dict[str, Any], eval_section: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """``overrides`` completed by a run config's eval section (--eval-settings); the flags given win."""
    if eval_section is None:
        raise ValueError(
            f"{where}: records no run config, so --eval-settings has nothing to take; give --tgt-len, "
            f"--mem-len, --clamp-len and --same-length instead"
        )
    taken = {
        key: eval_section[key]
        for key in ("tgt_len", "mem_len", "clamp_len", "same_length")
        if eval_section.get(key) is not None
    }
    return {**taken, **overrides}


def _load(
    path: Path,
    split: str,
    overrides: dict[str, Any],
    tokenizer_dir: str | None,
    device,
    verify: bool = True,
    eval_settings: bool = False,
    progress: bool = True,
) -> tuple[Any, Any, str | None, Path]:
    """(model, tokenizer or None, recorded shards or None, default output file)."""
    if not _ours(path):  # a transformers folder, the authors' state dict or release: read as train.init_from reads
        if eval_settings:
            raise ValueError(f"{path}: records no run config, so --eval-settings has nothing to take")
        source = open_source(path)
        config = apply_eval_overrides(source.config, overrides)
        model = model_from_state_dict(source.read_weights(), config, device=device, where=str(path))
        with source.tokenizer_directory() if source.tokenizer_directory else contextlib.nullcontext() as folder:
            tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else load_tokenizer(folder) if folder else None
        return model, tokenizer, None, path / f"eval_{split}.json"
    if (path / CONFIG_FILE).is_file():
        training = read_json(path / TRAINING_FILE) if (path / TRAINING_FILE).is_file() else {}
        if eval_settings:
            run_config = training.get("run_config")
            overrides = _with_eval_section(overrides, (run_config or {}).get("eval"), str(path))
        if not verify and int(os.environ.get("RANK", "0")) == 0:
            print(
                f"evaluate.py: warning: --no-verify: {path} is read without checking its files against checksums.json",
                file=sys.stderr,
            )
        model = load_model(path, device=device, verify=verify, **overrides)
        tokenizer = load_export_tokenizer(path)
        # An export converted from elsewhere (transformers, the authors' files) records no shards.
        data = training.get("data") if isinstance(training, dict) else None
        shards = data.get("shards") if isinstance(data, dict) else None
        return model, tokenizer, shards, path / f"eval_{split}.json"
    _verify_once(path, verify)
    checkpoint = read_training_checkpoint(path, verify=False)  # verified just above
    if eval_settings:
        overrides = _with_eval_section(
            overrides, dataclasses.asdict(checkpoint.run_config.eval), str(checkpoint.tag_dir)
        )
    config = apply_eval_overrides(checkpoint.run_config.model, overrides)
    # --no-progress holds for DeepSpeed's bars too ("Loading checkpoint shards" as it gathers the partitions).
    weights = _consolidate_once(checkpoint, functools.partial(consolidate_weights, progress=progress), device)
    model = model_from_state_dict(weights, config, device=device, where=str(checkpoint.tag_dir))
    tokenizer = load_tokenizer(find_tokenizer(checkpoint, tokenizer_dir))
    # Next to the checkpoints, not inside one: a checkpoint folder stays as the trainer wrote it.
    return (
        model,
        tokenizer,
        checkpoint.run_config.data.shards,
        checkpoint.run_dir / f"eval_{split}_{checkpoint.tag}.json",
    )


def _ours(path: Path) -> bool:
    """An export folder or a training run or checkpoint: what the evaluation reads itself (verifying once)."""
    if (path / CONFIG_FILE).is_file():
        return (path / WEIGHTS_FILE).is_file() and "format" in read_json(path / CONFIG_FILE)
    try:
        locate_checkpoint(path)
    except CheckpointError:
        return False
    return True


@contextlib.contextmanager
def model_tokenizer(model: str, tokenizer_dir: str | None = None) -> Iterator[Path]:
    """The folder of the tokenizer the model at ``model`` was trained with (``tokenizer_dir`` when given, checked
    against the model's record); a folder made for the while where the model keeps its vocabulary otherwise (the
    authors' TensorFlow release)."""
    path = Path(model)
    if (path / CONFIG_FILE).is_file() and _ours(path):
        tokenizer = load_export_tokenizer(path)
        if tokenizer is None and tokenizer_dir is None:
            raise ValueError(f"{path}: records no tokenizer; give --tokenizer DIR")
        yield Path(tokenizer_dir) if tokenizer_dir else tokenizer.directory
        return
    if _ours(path):
        yield find_tokenizer(read_training_checkpoint(path, verify=False), tokenizer_dir)
        return
    source = open_source(path)
    if tokenizer_dir is not None:
        found = load_tokenizer(tokenizer_dir).fingerprint
        if source.tokenizer is not None and source.tokenizer["fingerprint"] != found:
            raise ValueError(
                f"--tokenizer {tokenizer_dir}: fingerprint {found}, but {path} was trained with "
                f"{source.tokenizer['fingerprint']}"
            )
        yield Path(tokenizer_dir)
        return
    with source.tokenizer_directory() if source.tokenizer_directory else contextlib.nullcontext() as folder:
        if folder is None:
            raise ValueError(f"{path}: holds no txl_dist tokenizer (its kind: {source.kind}); give --tokenizer DIR")
        yield folder


def _consolidate_once(checkpoint, consolidate, device) -> dict:
    """The checkpoint's full weights on every rank, gathered from its ZeRO partitions by rank 0 alone (each
    rank reading every partition would multiply the reads and the host memory by the number of ranks)."""
    if not dist.is_initialized():
        return consolidate(checkpoint)
    return ranks.broadcast_tensors(consolidate(checkpoint) if dist.get_rank() == 0 else None, device)


def tokens_are_characters(tokenizer) -> bool:
    """Every piece that is not a special symbol is a single character (enwik8/text8-style data); byte and
    character tokenizers always are (a byte piece is written ``<0x41>``; bits per byte are enwik8's bpc)."""
    if getattr(tokenizer, "character_level", False):
        return True
    specials = {tokenizer.eos_id, tokenizer.eod_id, tokenizer.unk_id}
    pieces = (tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size) if i not in specials)
    return all(len(piece.lstrip("\u2581")) <= 1 for piece in pieces)


def evaluate_split(args: argparse.Namespace) -> dict[str, Any]:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: must be at least 1 (streams over all ranks)")
    if args.output is not None:
        _check_output(Path(args.output))
    rank, world_size, device = _distributed()
    overrides = {
        name: value
        for name, value in (
            ("tgt_len", args.tgt_len),
            ("mem_len", args.mem_len),
            ("clamp_len", args.clamp_len),
            ("same_length", args.same_length),
        )
        if value is not None
    }
    model, tokenizer, recorded_shards, default_output = _load(
        Path(args.model),
        args.split,
        overrides,
        args.tokenizer,
        device,
        verify=not args.no_verify,
        eval_settings=args.eval_settings,
        progress=not args.no_progress,
    )
    shards = args.shards or recorded_shards
    if shards is None:
        raise ValueError(f"{args.model} does not record its shards: pass --shards DIR")
    manifest = read_manifest(shards)
    if args.split not in manifest.splits:
        raise ValueError(f"--split {args.split!r}: {shards} has the splits {sorted(manifest.splits)}")
    fingerprint = tokenizer.fingerprint if tokenizer is not None else None
    per_rank = max(1, math.ceil(args.batch_size / world_size))
    with EvalStreams(
        shards,
        args.split,
        tgt_len=model.config.tgt_len,
        batch_size=per_rank,
        world_size=world_size,
        rank=rank,
        expected_fingerprint=fingerprint,
    ) as streams:
        result = evaluate(model, streams, device, progress=rank == 0 and not args.no_progress)
    _require_a_score(result.loss, args.split, shards)
    summary = _summary(args, shards, manifest.splits[args.split], model.config, result, world_size, per_rank)
    summary.update(_scores(result, manifest.splits[args.split], manifest.tokenizer.kind, tokenizer))
    # Scores of --text go to a file only where --output names one: the model's folder may not be ours to write.
    summary["output"] = args.output or (None if getattr(args, "text", None) else str(default_output))
    return summary if rank == 0 else {}


def _check_output(output: Path) -> None:
    """Refuse, before the evaluation, an ``--output`` that the result could not be written to as asked: a dangling
    symbolic link (the atomic write would replace the link, not create its target), a folder, or a missing one."""
    target = dangling_link(output)
    if target is not None:
        raise ValueError(
            f"--output {output}: a symbolic link to {target}, which leads nowhere: remove the link or "
            f"choose another output"
        )
    if output.is_dir():
        raise ValueError(f"--output {output}: a folder; give the JSON file to write (e.g. {output / 'eval.json'})")
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: no folder {output.parent} to write it in")


def _summary(args, shards, split, config, result, world_size: int, per_rank: int) -> dict[str, Any]:
    """The result's record: what was scored, with which settings, and its loss, perplexities and bits."""
    summary: dict[str, Any] = {
        "model": str(args.model),
        **({"text": list(args.text)} if getattr(args, "text", None) else {"shards": str(shards), "split": args.split}),
        "ranks": world_size,
        "settings": {
            "tgt_len": config.tgt_len,
            "mem_len": config.mem_len,
            "clamp_len": config.clamp_len,
            "same_length": config.same_length,
            "batch_size": per_rank * world_size,
        },
        "tokens": result.targets,
        "loss": result.loss,
    }
    return summary


def _scores(result, split, kind: str, tokenizer) -> dict[str, Any]:
    """What the loss means for this kind of tokenizer: bits per character for byte and char tokenizers (per byte:
    enwik8's bpc), whose tokens are no words; perplexity per token and per word for word and subword tokenizers
    (and bits per character too when every piece is one character)."""
    bits = result.loss / math.log(2)
    if kind in CHARACTER_KINDS:
        return {"bits_per_character": bits}
    scores: dict[str, Any] = {"ppl": result.ppl, "bits_per_token": bits}
    if split.words > 1:
        # The first word of the split has no context, like the first token.
        scores["words"] = split.words
        scores["word_ppl"] = perplexity(result.nll_sum / (split.words - 1))
    if tokenizer is not None and tokens_are_characters(tokenizer):
        scores["bits_per_character"] = bits
    return scores


def _require_a_score(loss: float, split: str, shards: str) -> None:
    """_SharedError when ``loss`` gives no perplexity to write."""
    if not math.isfinite(loss):
        # Strict JSON has no NaN; and a non-finite score of finite weights is a fault to report, not a result.
        raise _SharedError(
            f"the loss on split {split!r} of {shards} is {loss}, with finite weights (the "
            f"forward pass overflowed): no result written"
        )
    if loss >= math.log(sys.float_info.max):
        raise _SharedError(
            f"the loss on split {split!r} of {shards} is {loss:.1f} nats per token: its "
            f"perplexity is beyond a float (the model does not predict this text): no result written"
        )


def evaluate_and_write(args: argparse.Namespace) -> int:
    """Score the split as ``args`` asks and write the result (rank 0); the exit status: 0, 2 for a refused input
    (printed once, by the rank that found it or by rank 0 for an error every rank shares), 1 for a failure."""
    try:
        summary = evaluate_split(args)
    except (ValueError, OSError) as error:
        if not isinstance(error, _SharedError) or int(os.environ.get("RANK", "0")) == 0:
            print_error("evaluate.py", describe_error(error))
        return exit_status(error)  # 2 for a refused input; 1 for an OSError of the surroundings (no space, ...)
    if dist.is_initialized():
        # Every rank past its last collective before any tears gloo down (a rank that destroyed its group while
        # the other still finished its part aborted once at exit, "terminate called without an active
        # exception"); one left to interpreter shutdown can abort the process at exit too.
        dist.barrier()
        dist.destroy_process_group()
    if summary:
        try:
            if summary["output"] is not None:
                atomic_write_text(summary["output"], json.dumps(summary, indent=1, allow_nan=False) + "\n")
        except OSError as error:
            print_error(
                "evaluate.py",
                f"{describe_os_error(error)} (the result was: {summary['split']} loss {summary['loss']:.4f})",
            )
            return os_error_status(error)
        scored = summary.get("split") or ", ".join(summary["text"])
        line = f"{scored}: {summary['tokens']} tokens, loss {summary['loss']:.4f}"
        if "ppl" in summary:
            line += f", ppl {summary['ppl']:.2f}"
        if "word_ppl" in summary:
            line += f", word ppl {summary['word_ppl']:.2f}"
        if "bits_per_character" in summary:
            line += f", {summary['bits_per_character']:.4f} bits/char"
        print(f"{line}  ({summary['output']})" if summary["output"] else line)
    return 0
