"""Any model txl_dist reads, opened by one path: its config and tokenizer identity now, its weights on demand
(`txl_dist.training.init_from.InitSource`; ``train.init_from`` and ``launchers/evaluate.py --text`` read models
through it).

What a path may be, told apart by what it holds:

- an export folder (config.json of our format, model.safetensors);
- a training run folder, its checkpoints/ folder or one checkpoint (any ZeRO stage and world size);
- a transformers TransfoXL folder (config.json with model_type "transfo-xl": save_pretrained of 4.37, or
  export-to-hf);
- a folder of export-to-hub (model_type "txl_dist_transformer_xl", for current transformers);
- the authors' PyTorch state dict: a ``.pt`` file with ``config.json`` (their argument names) beside it, or a
  folder holding one ``.pt`` and ``config.json``;
- the authors' TensorFlow release (a folder with model/ and data/, their download.sh layout), read with
  TensorFlow (`txl_dist.convert.tf_release`).

Anything else is refused in one line that lists these.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from txl_dist.checkpoint_paths import COMPLETE
from txl_dist.convert import tf_release
from txl_dist.convert.hf import hf_weights_file, read_hf_config, read_hf_weights
from txl_dist.convert.hub import MODEL_TYPE, WEIGHTS_FILE, read_hub_config, read_hub_weights
from txl_dist.convert.original import from_original_state_dict, load_original
from txl_dist.convert.zero import CheckpointError, consolidate_weights, find_tokenizer, read_training_checkpoint
from txl_dist.export import CONFIG_FILE, TOKENIZER_DIR, load_model, read_config_file
from txl_dist.export.config_file import describe_folder, read_json_object
from txl_dist.fileio import sha256_files
from txl_dist.run_paths import CHECKPOINTS
from txl_dist.tokenizer import load_tokenizer
from txl_dist.training.init_from import InitSource

KINDS = (
    "an export folder",
    "a training run or checkpoint",
    "a transformers TransfoXL folder",
    "a folder of export-to-hub",
    "the authors' state dict (.pt with config.json)",
    "the authors' TensorFlow release (model/ and data/)",
)


def open_source(path: str | os.PathLike) -> InitSource:
    """The model at ``path`` (see the module docstring); ValueError, naming the path, for one that holds no model
    txl_dist reads or whose files are damaged."""
    where = Path(path)
    if not where.exists():
        raise ValueError(f"{path}: no such file or folder")
    if where.is_file():
        if where.suffix in (".pt", ".pth", ".bin"):
            return _authors_state_dict(str(path), where, where.parent / CONFIG_FILE)
        raise ValueError(_no_model(path))
    config_path = where / CONFIG_FILE
    if config_path.is_file():
        data = read_json_object(config_path, "not a model's config.json")
        model_type = data.get("model_type")
        if model_type == "transfo-xl":
            return _hf_folder(str(path), where)
        if model_type == MODEL_TYPE:
            return _hub_folder(str(path), where)
        if (where / WEIGHTS_FILE).is_file() and "format" in data:
            return _export(str(path), where)
        weights = sorted(where.glob("*.pt")) + sorted(where.glob("*.pth"))
        if len(weights) == 1:
            return _authors_state_dict(str(path), weights[0], config_path)
    if (where / "model").is_dir() and (where / "data").is_dir():
        return _tf_release(str(path), where)
    if (where / CHECKPOINTS).is_dir() or (where / COMPLETE).is_file() or where.name == CHECKPOINTS:
        return _training_checkpoint(str(path), where)
    raise ValueError(_no_model(path))


def _no_model(path: str | os.PathLike) -> str:
    what = describe_folder(Path(path)) if Path(path).is_dir() else "a file"
    return (
        f"{path}: {what + ', which ' if what else ''}holds no model txl_dist reads (it reads "
        f"{', '.join(KINDS[:-1])}, or {KINDS[-1]})"
    )


def _identity_of(tokenizer_dir: Path | None) -> dict[str, Any] | None:
    return load_tokenizer(tokenizer_dir).identity() if tokenizer_dir is not None else None


def _folder(tokenizer_dir: Path | None):
    """`InitSource.tokenizer_directory` for a tokenizer folder that exists (or none)."""
    return lambda: contextlib.nullcontext(tokenizer_dir)


def _export(path: str, where: Path) -> InitSource:
    config, identity = read_config_file(where / CONFIG_FILE)
    return InitSource(
        path,
        "an export folder",
        config,
        identity,
        sha256_files([where / WEIGHTS_FILE]),
        {},
        lambda: load_model(where).state_dict(),  # checks the files against checksums.json first
        _folder(where / TOKENIZER_DIR if identity is not None else None),
    )


def _training_checkpoint(path: str, where: Path) -> InitSource:
    try:
        checkpoint = read_training_checkpoint(where, verify=False)  # the config: verified when the weights are read
    except CheckpointError as error:
        raise ValueError(str(error)) from None
    client = checkpoint.client
    return InitSource(
        path,
        "a training checkpoint",
        checkpoint.run_config.model,
        client.get("tokenizer"),
        sha256_files([checkpoint.tag_dir / COMPLETE]),  # it lists every file of the checkpoint with its checksum
        {"checkpoint": str(checkpoint.tag_dir.resolve()), "step": client.get("step")},
        lambda: consolidate_weights(read_training_checkpoint(where, verify=True), progress=False),
        lambda: contextlib.nullcontext(find_tokenizer(checkpoint)),
    )


def _hf_folder(path: str, where: Path) -> InitSource:
    config, identity, tokenizer_dir = read_hf_config(where)
    identity = identity or _identity_of(tokenizer_dir)
    return InitSource(
        path,
        "a transformers TransfoXL folder",
        config,
        identity,
        sha256_files([hf_weights_file(where)]),
        {},
        lambda: read_hf_weights(where, config),
        _folder(tokenizer_dir),
    )


def _hub_folder(path: str, where: Path) -> InitSource:
    config, identity = read_hub_config(where)
    return InitSource(
        path,
        "a folder of export-to-hub",
        config,
        identity,
        sha256_files([where / WEIGHTS_FILE]),
        {},
        lambda: read_hub_weights(where, config),
    )


def _authors_state_dict(path: str, weights: Path, config_path: Path) -> InitSource:
    if not config_path.is_file():
        raise ValueError(
            f"{weights}: the authors' state dict needs its config.json (their argument names) beside it, "
            f"at {config_path}"
        )
    config, identity = read_config_file(config_path)
    tokenizer_dir = weights.parent / "tokenizer"
    identity = identity or _identity_of(tokenizer_dir if tokenizer_dir.is_dir() else None)
    return InitSource(
        path,
        "the authors' state dict",
        config,
        identity,
        sha256_files([weights]),
        {},
        lambda: from_original_state_dict(load_original(weights), config),
        _folder(tokenizer_dir if tokenizer_dir.is_dir() else None),
    )


def _tf_release(path: str, where: Path) -> InitSource:
    opened = tf_release.open_release(where)
    with tf_release.authors_tokenizer(opened) as folder:
        identity = load_tokenizer(folder).identity()
    source = opened.source()
    return InitSource(
        path,
        "the authors' TensorFlow release",
        opened.config,
        identity,
        source["sha256"],
        {"checkpoint": source["checkpoint"], "dataset": opened.dataset},
        opened.weights,
        lambda: tf_release.authors_tokenizer(opened),
    )
