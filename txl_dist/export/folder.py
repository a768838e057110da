"""Writing and loading an export folder: its files written in a staging folder renamed into place, and read back.

An export is written into a temporary folder next to OUT and renamed into place, so OUT is never half written;
checksums.json is written last. Loading verifies the files against it first, then reads the config, the weights
and the tokenizer, each checked against the others.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from txl_dist.export.checksums import require_verified_export, write_checksums
from txl_dist.export.config_file import (
    CONFIG_FILE,
    apply_eval_overrides,
    config_to_json,
    read_export_config,
)
from txl_dist.export.tokenizer_files import copy_tokenizer, load_export_tokenizer, tokenizer_to_export
from txl_dist.export.weights import (
    WEIGHTS_FILE,
    read_export_weights,
    require_finite,
    save_export_weights,
    standalone,
    tensor_shapes,
    unique_weights,
)
from txl_dist.model import ModelConfig, TransformerXLLM
from txl_dist.output_folders import check_output_path, staged_output

if TYPE_CHECKING:
    from txl_dist.tokenizer import Tokenizer

TRAINING_FILE = "training.json"


def _state_of(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], config: ModelConfig):
    """The state dict to export; a model must have ``config``'s architecture."""
    if not isinstance(model_or_state_dict, nn.Module):
        return model_or_state_dict
    model_config = getattr(model_or_state_dict, "config", None)
    if isinstance(model_config, ModelConfig) and model_config.architecture() != config.architecture():
        raise ValueError(
            f"the model's architecture {model_config.architecture()} differs from the config's {config.architecture()}"
        )
    return model_or_state_dict.state_dict()


def write_export(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    config: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    tokenizer_identity: Mapping[str, Any] | None = None,
    training_info: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an export folder (see `txl_dist.export`) and return its path.

    ``tokenizer_dir``: a tokenizer directory (its ``tokenizer.json`` lists the files) to copy into
    ``OUT/tokenizer/``; ``tokenizer_identity``: the identity a checkpoint recorded, checked against that
    directory, or recorded alone when there is none. Either must agree with ``config.n_token``.
    ``training_info``: free-form JSON for ``training.json``. An existing ``out_dir`` is an error unless
    ``overwrite``, which replaces only an empty folder or one that txl_dist wrote
    (`txl_dist.output_folders.check_output_path`).
    """
    out_dir = check_output_path(out_dir, overwrite=overwrite)
    state = _state_of(model_or_state_dict, config)
    weights = {key: standalone(value) for key, value in unique_weights(state, config).items()}
    require_finite(weights, "the weights to export")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    identity, tokenizer_files = tokenizer_to_export(tokenizer_dir, tokenizer_identity, config.n_token)
    config_text = json.dumps(config_to_json(config, identity), indent=1) + "\n"
    training_text = json.dumps(dict(training_info), indent=1) + "\n" if training_info is not None else None

    with staged_output(out_dir, "txl_dist.export.write_export") as staging:
        save_export_weights(weights, config, staging / WEIGHTS_FILE)
        if tokenizer_dir is not None:
            copy_tokenizer(tokenizer_dir, tokenizer_files, staging)
        if training_text is not None:
            (staging / TRAINING_FILE).write_text(training_text, encoding="utf-8")
        # Last: a folder with config.json and no weights never exists, even inside the staging folder.
        (staging / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        write_checksums(staging)
    return out_dir


def load_model(
    export_dir: str | os.PathLike, *, device: str | torch.device = "cpu", verify: bool = True, **overrides: Any
) -> TransformerXLLM:
    """The model of an export folder, in eval mode, on ``device``.

    ``overrides`` change evaluation settings only (`EVAL_SETTINGS`: tgt_len, mem_len, clamp_len, same_length,
    attn_impl, mem_dtype, dropout, dropatt); any other field is refused by name. ``verify``: check the files
    against checksums.json first (`require_verified_export`).
    """
    export_dir = Path(export_dir)
    require_verified_export(export_dir, verify)
    config = apply_eval_overrides(read_export_config(export_dir), overrides)
    weights_path = export_dir / WEIGHTS_FILE
    tensors = read_export_weights(weights_path, config, device, export_dir / CONFIG_FILE)
    return model_from_state_dict(tensors, config, device=device, where=str(weights_path))


def model_from_state_dict(
    state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    where: str = "state dict",
) -> TransformerXLLM:
    """A model in eval mode holding ``state`` (with or without the keys of tied tensors, e.g. DeepSpeed's
    consolidated weights); a missing, extra or misshapen weight is an error naming it."""
    weights = unique_weights(state, config, where)
    require_finite(weights, where)
    _, aliases = tensor_shapes(config)
    with torch.device(device):
        model = TransformerXLLM(config)
    model.load_state_dict({**weights, **{alias: weights[stored] for alias, stored in aliases.items()}}, strict=True)
    return model.eval()


def load_pretrained(
    export_dir: str | os.PathLike, *, device: str | torch.device = "cpu", verify: bool = True, **overrides: Any
) -> tuple[TransformerXLLM, Tokenizer | None]:
    """(model in eval mode, tokenizer or None) of an export folder; ``overrides`` and ``verify`` as in
    `load_model` (the files are verified before any is read)."""
    require_verified_export(export_dir, verify)
    tokenizer = load_export_tokenizer(export_dir)
    return load_model(export_dir, device=device, verify=False, **overrides), tokenizer
