"""An export's model.safetensors: the weights checked key by key against the config, each tied tensor stored once.

safetensors refuses tensors that share memory, so a tied tensor (``crit.out_layers.i.weight`` with
``tie_weight``, ``crit.out_projs.i`` with ``tie_projs``) is stored under its embedding's name only, and the
file's metadata lists the ties (``txl_dist.tied``: alias -> stored name); loading checks them against the
config and ties them again. Weights that hold NaN or infinity are refused, naming the tensors (`require_finite`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from txl_dist.fileio import chmod_as_new_file
from txl_dist.model import ModelConfig, TransformerXLLM

WEIGHTS_FILE = "model.safetensors"
TIED_METADATA_KEY = "txl_dist.tied"


def tensor_shapes(config: ModelConfig) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """(shape of every state-dict key, {tied alias: the name it is stored under}) of the model ``config`` builds.

    The ties are read off the model itself (one Parameter under two names), so they follow whatever
    tie_weight / tie_projs do in `TransformerXLLM`. The first name is the embedding's, as in named_parameters.
    """
    with torch.device("meta"):
        model = TransformerXLLM(config)
    shapes = {key: value.shape for key, value in model.state_dict().items()}
    first_name: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        stored = first_name.setdefault(id(param), name)
        if stored != name:
            aliases[name] = stored
    return shapes, aliases


def check_keys_and_shapes(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], where: str) -> None:
    """ValueError naming the missing and unexpected keys of ``state``, or the first tensor of the wrong shape."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where}: the weights do not match the configuration: missing {missing}, unexpected {unexpected}"
        )
    for key, shape in expected.items():
        if state[key].shape != shape:
            raise ValueError(
                f"{where}: {key} has shape {list(state[key].shape)}, but the configuration gives {list(shape)}"
            )


def unique_weights(
    state: Mapping[str, torch.Tensor], config: ModelConfig, where: str = "state dict"
) -> dict[str, torch.Tensor]:
    """The state dict with each tied tensor once (under the embedding's name), checked key by key and shape by
    shape against ``config``. A tied alias may be absent (DeepSpeed's consolidated weights list each parameter
    once) or present, in which case it must equal the tensor it is tied to."""
    shapes, aliases = tensor_shapes(config)
    state = dict(state)
    for alias, stored in aliases.items():
        if alias not in state:
            continue
        value = state.pop(alias)
        if stored not in state:
            state[stored] = value
        elif value is not state[stored] and not (
            value.shape == state[stored].shape and torch.equal(value, state[stored])
        ):
            raise ValueError(
                f"{where}: {alias} differs from {stored}, but the configuration ties them "
                f"(tie_weight={config.tie_weight}, tie_projs={config.tie_projs_resolved})"
            )
    check_keys_and_shapes(state, {k: s for k, s in shapes.items() if k not in aliases}, where)
    return state


def standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns exactly its bytes (what safetensors stores)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def require_finite(state: Mapping[str, torch.Tensor], where: str) -> None:
    """ValueError naming the tensors of ``state`` that hold NaN or infinity (damaged bytes, or a diverged run):
    such a model scores NaN and cannot sample."""
    bad = []
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad.append(f"{name} ({int((~torch.isfinite(tensor)).sum()):,} of {tensor.numel():,} values)")
    if bad:
        raise ValueError(
            f"{where}: weights hold NaN or infinity: {', '.join(bad[:5])}"
            f"{f' and {len(bad) - 5} more tensors' if len(bad) > 5 else ''}"
        )


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, whose I/O failures (no space left, ...) become the OSError they are, and whose
    file gets the mode that the umask gives."""
    try:
        save_file(dict(tensors), str(path), metadata=metadata)
        chmod_as_new_file(path)  # safetensors makes its files 0600, whatever the umask
    except SafetensorError as error:
        code = re.search(r"os error (\d+)", str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from error


def save_export_weights(weights: Mapping[str, torch.Tensor], config: ModelConfig, path: Path) -> None:
    """Write the unique weights of ``config``'s model with its ties in the metadata."""
    _, aliases = tensor_shapes(config)
    save_safetensors(weights, path, metadata={"format": "pt", TIED_METADATA_KEY: json.dumps(aliases, sort_keys=True)})


def read_export_weights(
    weights_path: Path, config: ModelConfig, device: str | torch.device, config_path: Path
) -> dict[str, torch.Tensor]:
    """The tensors of an export's weights file on ``device``, their ties, keys and shapes checked against
    ``config`` (read from ``config_path``, which errors name)."""
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path}: missing (the weights of the export)")
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(weights_path), device=str(device))
    except SafetensorError as error:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({error})") from error
    shapes, aliases = tensor_shapes(config)
    recorded_aliases = json.loads(metadata.get(TIED_METADATA_KEY, "{}"))
    if recorded_aliases != aliases:
        raise ValueError(
            f"{weights_path}: stored with the ties {recorded_aliases}, but {config_path} "
            f"(tie_weight, tie_projs) gives {aliases}"
        )
    check_keys_and_shapes(tensors, {k: s for k, s in shapes.items() if k not in aliases}, str(weights_path))
    return tensors
