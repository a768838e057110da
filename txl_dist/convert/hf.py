"""Our model <-> HuggingFace transformers' TransfoXL (4.37.2, the last release whose Transformer-XL runs).

The weight map is explicit (`KEY_MAP`): every key of either side is produced by one rule, and a key no rule
covers is an error. The two layouts share the authors' module names; HuggingFace nests the body under ``transformer.``.
Differences that are not names:

- HuggingFace ties projections only as ``[False, True, True, ...]`` (``proj_share_all_but_first``) or not at
  all, so other ``tie_projs`` settings cannot be exported when projections exist.
- HuggingFace keeps n_layer memory tensors (the input of each layer); ours keeps n_layer + 1 (the paper's,
  including the last layer's output). ``mems[:n_layer]`` of ours is HuggingFace's.
- HuggingFace starts from ``mem_len`` zero vectors when given no memory; ours from an empty memory. Pass
  ``[torch.empty(0, B, d_model)] * n_layer`` to HuggingFace for the same first segment.

Nothing here imports transformers at module level: the config is exchanged as a plain dict.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from txl_dist.config.model import ModelConfig
from txl_dist.convert.keymap import KeyMap
from txl_dist.export import (
    CONFIG_FILE,
    TOKENIZER_DIR,
    load_model,
    read_config_file,
    require_export_folder,
    unique_weights,
)
from txl_dist.export.config_file import read_json_object
from txl_dist.export.weights import save_safetensors
from txl_dist.output_folders import check_output_path, copy_tree, staged_output

# Our keys and HuggingFace's TransfoXLLMHeadModel keys.
KEY_MAP = KeyMap(
    [
        ("word_emb.{rest}", "transformer.word_emb.{rest}"),
        ("r_{which}_bias", "transformer.r_{which}_bias"),
        ("layers.{layer}.{rest}", "transformer.layers.{layer}.{rest}"),
        ("crit.{rest}", "crit.{rest}"),
    ],
    source_name="txl_dist",
    target_name="HuggingFace",
)


def _hf_tie_projs_flag(config: ModelConfig) -> bool:
    """HuggingFace's ``proj_share_all_but_first`` for our tie_projs; raise if it cannot express them."""
    has_projections = config.div_val > 1 or config.d_model != config.d_embed_resolved
    tie = config.tie_projs_resolved
    if not has_projections:
        return True
    if tie == [False] + [True] * config.n_clusters:
        return True
    if not any(tie):
        return False
    raise ValueError(
        f"model.tie_projs={tie} cannot be expressed in HuggingFace's TransfoXL, which ties either every tail "
        f"projection but not the head's, or none"
    )


def to_hf_config(config: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TransfoXLConfig``."""
    return dict(
        vocab_size=config.n_token,
        cutoffs=list(config.cutoffs),
        d_model=config.d_model,
        d_embed=config.d_embed_resolved,
        n_head=config.n_head,
        d_head=config.d_head,
        d_inner=config.d_inner,
        div_val=config.div_val,
        pre_lnorm=config.pre_lnorm,
        n_layer=config.n_layer,
        mem_len=config.mem_len,
        clamp_len=config.clamp_len,
        same_length=config.same_length,
        proj_share_all_but_first=_hf_tie_projs_flag(config),
        attn_type=0,
        sample_softmax=-1,
        adaptive=True,
        dropout=config.dropout,
        dropatt=config.dropatt,
        untie_r=config.untie_r,
        init="normal",
        init_std=config.init_std,
        proj_init_std=config.proj_init_std,
        layer_norm_epsilon=config.layer_norm_eps,
        tie_word_embeddings=config.tie_weight,
    )


def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """A ModelConfig from a TransfoXLConfig's ``to_dict()`` (or its config.json)."""
    if hf.get("attn_type", 0) != 0:
        raise ValueError(f"attn_type={hf['attn_type']} is not Transformer-XL's relative attention (attn_type=0)")
    if hf.get("sample_softmax", -1) > 0:
        raise ValueError("sample_softmax models are not supported")
    # HuggingFace builds its adaptive embedding and softmax from `cutoffs` whatever `adaptive` says.
    cutoffs = list(hf["cutoffs"])
    if "tie_projs" in hf:  # what TransfoXLConfig saves
        tie_projs = [bool(t) for t in hf["tie_projs"]]
    else:  # what its constructor takes
        tie_projs = [False] + [bool(hf.get("proj_share_all_but_first", False))] * len(cutoffs)
    fields = dict(
        n_token=hf["vocab_size"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        d_head=hf["d_head"],
        d_model=hf["d_model"],
        d_inner=hf["d_inner"],
        d_embed=hf["d_embed"],
        div_val=hf["div_val"],
        cutoffs=cutoffs,
        tie_weight=bool(hf.get("tie_word_embeddings", True)),
        tie_projs=tie_projs,
        untie_r=bool(hf.get("untie_r", True)),
        pre_lnorm=bool(hf.get("pre_lnorm", False)),
        dropout=hf.get("dropout", 0.1),
        dropatt=hf.get("dropatt", 0.0),
        mem_len=hf.get("mem_len", 0),
        clamp_len=hf.get("clamp_len", -1),
        same_length=bool(hf.get("same_length", False)),
        init_std=hf.get("init_std", 0.02),
        proj_init_std=hf.get("proj_init_std", 0.01),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )
    fields.update(overrides)
    return ModelConfig.from_dict(fields, where="HuggingFace config")


def sinusoid_inv_freq(d_model: int) -> torch.Tensor:
    """The ``pos_emb.inv_freq`` buffer that the authors' code (and HuggingFace's) registers: derived, not learned."""
    return 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model))


def to_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> the keys of TransfoXLLMHeadModel (strict load)."""
    hf = KEY_MAP.forward(state)
    if not config.untie_r:
        # HuggingFace registers the shared biases again under every layer.
        for i in range(config.n_layer):
            for which in ("w", "r"):
                hf[f"transformer.layers.{i}.dec_attn.r_{which}_bias"] = state[f"r_{which}_bias"]
    hf["transformer.pos_emb.inv_freq"] = sinusoid_inv_freq(config.d_model)
    return hf


def from_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """TransfoXLLMHeadModel's state dict -> ours (the per-layer copies of shared biases and the sinusoid
    frequencies are derived, not weights)."""
    state = dict(state)
    state.pop("transformer.pos_emb.inv_freq", None)
    if not config.untie_r:
        for i in range(config.n_layer):
            for which in ("w", "r"):
                copy = state.pop(f"transformer.layers.{i}.dec_attn.r_{which}_bias", None)
                shared = state.get(f"transformer.r_{which}_bias")
                if copy is not None and (shared is None or not torch.equal(copy, shared)):
                    raise ValueError(
                        f"layer {i} has its own r_{which}_bias but the config says untie_r=false; "
                        f"convert with untie_r=true"
                    )
    return KEY_MAP.backward(state)


# ---------------------------------------------------------------------------------------------------------------
# HuggingFace folders (what ``TransfoXLLMHeadModel.from_pretrained`` reads), written and read without importing
# transformers.

HF_WEIGHTS = "model.safetensors"
HF_LEGACY_WEIGHTS = "pytorch_model.bin"
HF_TOKENIZER_KEY = "txl_dist_tokenizer"
"""config.json key recording our tokenizer's identity; the tokenizer's files travel in ``tokenizer/``."""
HF_SETTINGS_KEY = "txl_dist_settings"
"""config.json key for our settings TransfoXLConfig has no field for, so that a round trip is exact."""
_SETTINGS_HF_LACKS = ("tgt_len", "attn_impl", "mem_dtype")


def write_hf_folder(
    export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False, verify: bool = True
) -> Path:
    """An export folder -> a folder transformers 4.37.2 loads with ``TransfoXLLMHeadModel.from_pretrained``.

    ``out_dir`` may not be, contain or lie inside ``export_dir``; ``overwrite`` replaces only an empty folder or
    one txl_dist wrote (`txl_dist.output_folders.check_output_path`)."""
    export_dir = Path(export_dir)
    out_dir = check_output_path(out_dir, [export_dir], overwrite=overwrite)
    require_export_folder(export_dir)
    config, identity = read_config_file(export_dir / CONFIG_FILE)
    state = to_hf_state_dict(unique_weights(load_model(export_dir, verify=verify).state_dict(), config), config)
    # Shared tensors (the per-layer copies of the position biases) are written as copies: safetensors
    # refuses aliases; HuggingFace re-ties the crit weights it lists in _tied_weights_keys itself.
    weights = {key: tensor.detach().contiguous().clone() for key, tensor in state.items()}
    hf_config = {
        **to_hf_config(config),
        "model_type": "transfo-xl",
        "architectures": ["TransfoXLLMHeadModel"],
        HF_TOKENIZER_KEY: identity,
        HF_SETTINGS_KEY: {name: getattr(config, name) for name in _SETTINGS_HF_LACKS},
    }
    with staged_output(out_dir, "txl_dist.convert.hf.write_hf_folder") as staging:
        save_safetensors(weights, staging / HF_WEIGHTS, metadata={"format": "pt"})
        if (export_dir / TOKENIZER_DIR).is_dir():
            copy_tree(export_dir / TOKENIZER_DIR, staging / TOKENIZER_DIR)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=1) + "\n", encoding="utf-8")
    return out_dir


def read_hf_folder(hf_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], dict | None, Path | None]:
    """(config, our state dict, tokenizer identity or None, tokenizer directory or None) of a HuggingFace
    TransfoXL folder (``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``)."""
    hf_dir = Path(hf_dir)
    config, identity, tokenizer_dir = read_hf_config(hf_dir)
    return config, read_hf_weights(hf_dir, config), identity, tokenizer_dir


def read_hf_config(hf_dir: str | os.PathLike) -> tuple[ModelConfig, dict | None, Path | None]:
    """(config, tokenizer identity or None, tokenizer directory or None) of a HuggingFace TransfoXL folder, from
    its ``config.json`` alone."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    hf_config = read_json_object(config_path, "not a HuggingFace model folder")
    if hf_config.get("model_type") not in (None, "transfo-xl"):
        raise ValueError(f"{config_path}: model_type is {hf_config.get('model_type')!r}, expected 'transfo-xl'")
    config = from_hf_config(hf_config, **hf_config.get(HF_SETTINGS_KEY, {}))
    tokenizer_dir = hf_dir / "tokenizer"
    return config, hf_config.get(HF_TOKENIZER_KEY), tokenizer_dir if tokenizer_dir.is_dir() else None


def hf_weights_file(hf_dir: Path) -> Path:
    """The folder's weights: model.safetensors, else pytorch_model.bin."""
    for name in (HF_WEIGHTS, HF_LEGACY_WEIGHTS):
        if (hf_dir / name).is_file():
            return hf_dir / name
    raise FileNotFoundError(f"{hf_dir}: neither {HF_WEIGHTS} nor {HF_LEGACY_WEIGHTS}")


def read_hf_weights(hf_dir: str | os.PathLike, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a HuggingFace TransfoXL folder's weights (safetensors, or a weights-only pickle)."""
    hf_dir = Path(hf_dir)
    if (hf_dir / HF_WEIGHTS).is_file():
        try:
            state = load_file(str(hf_dir / HF_WEIGHTS))
        except SafetensorError as error:  # truncated or overwritten: one line, not the library's traceback
            raise ValueError(f"{hf_dir / HF_WEIGHTS}: not a readable safetensors file ({error})") from None
    elif (hf_dir / HF_LEGACY_WEIGHTS).is_file():
        path = hf_dir / HF_LEGACY_WEIGHTS
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:  # a pickle that asks for more than tensors: never run
            found = re.search(r"GLOBAL ([\w.]+)", str(error))
            what = f"it refers to {found.group(1)}" if found else str(error).strip().splitlines()[0]
            raise ValueError(
                f"{path}: refused to unpickle: {what}, which is not a tensor (the weights-only loader "
                f"reads tensors and containers only; loading this file could run code)"
            ) from None
        except (RuntimeError, EOFError) as error:  # truncated or not a torch file
            raise ValueError(
                f"{path}: not a readable PyTorch weights file ({str(error).strip().splitlines()[0]})"
            ) from None
        if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
            raise ValueError(f"{path}: not a state dict of tensors")
    else:
        hf_weights_file(hf_dir)  # raises: neither file
    return from_hf_state_dict(state, config)
