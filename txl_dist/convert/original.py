"""Our model <-> the state dict of the authors' PyTorch code (kimiyoung/transformer-xl, ``pytorch/mem_transformer.py``).

Our module names are the authors', so `KEY_MAP` maps every name to itself; it is still an explicit table, so a
key the authors' ``MemTransformerLM`` (attn_type 0, adaptive softmax) does not have is an error, not a silently
carried weight. The differences that are not names, read from the authors' source:

- The head's cluster rows. Their ``ProjectedAdaptiveLogSoftmax`` appends ``cluster_weight`` / ``cluster_bias``
  to the head's rows and reads tail cluster i's logit from column ``-i`` of the head (``head_logprob_i[:, -i]``),
  i.e. row ``n_clusters - i`` of ``cluster_weight``. Ours (like HuggingFace's port) reads row ``i - 1``. Both
  tensors are therefore stored in reverse row order on their side.
- ``pos_emb.inv_freq`` is a registered buffer on their side; it is derived from d_model, not learned.
- Their code has one model-level ``r_w_bias`` / ``r_r_bias`` (no untie_r) and LayerNorm's default epsilon
  (1e-5): models with ``untie_r=true`` or another ``layer_norm_eps`` cannot be expressed and are refused.
- Their ``train.py`` saves whole pickled modules (``torch.save(model, f)``), which cannot be read safely;
  `load_original` accepts state dicts only and says how to make one.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch

from txl_dist.config.model import ModelConfig
from txl_dist.convert.hf import sinusoid_inv_freq
from txl_dist.convert.keymap import KeyMap
from txl_dist.fileio import atomic_write

# The authors' nn.LayerNorm(d_model) everywhere: PyTorch's default epsilon.
AUTHORS_LAYER_NORM_EPS = 1e-5
INV_FREQ_KEY = "pos_emb.inv_freq"
_REVERSED_ROWS = ("crit.cluster_weight", "crit.cluster_bias")

_LAYER_KEYS = (
    "dec_attn.qkv_net.weight",
    "dec_attn.r_net.weight",
    "dec_attn.o_net.weight",
    "dec_attn.layer_norm.weight",
    "dec_attn.layer_norm.bias",
    "pos_ff.CoreNet.0.weight",
    "pos_ff.CoreNet.0.bias",
    "pos_ff.CoreNet.3.weight",
    "pos_ff.CoreNet.3.bias",
    "pos_ff.layer_norm.weight",
    "pos_ff.layer_norm.bias",
)

# Our keys and the authors' MemTransformerLM keys (identical names, listed so that nothing passes unchecked).
KEY_MAP = KeyMap(
    [
        ("word_emb.emb_layers.{i}.weight", "word_emb.emb_layers.{i}.weight"),
        ("word_emb.emb_projs.{i}", "word_emb.emb_projs.{i}"),
        ("r_w_bias", "r_w_bias"),
        ("r_r_bias", "r_r_bias"),
        *((f"layers.{{layer}}.{key}", f"layers.{{layer}}.{key}") for key in _LAYER_KEYS),
        ("crit.cluster_weight", "crit.cluster_weight"),
        ("crit.cluster_bias", "crit.cluster_bias"),
        ("crit.out_layers.{i}.weight", "crit.out_layers.{i}.weight"),
        ("crit.out_layers.{i}.bias", "crit.out_layers.{i}.bias"),
        ("crit.out_projs.{i}", "crit.out_projs.{i}"),
    ],
    source_name="txl_dist",
    target_name="the authors' PyTorch layout",
)


def check_expressible(config: ModelConfig) -> None:
    """Raise ValueError when the authors' PyTorch model cannot hold this configuration."""
    if config.untie_r:
        raise ValueError(
            "model.untie_r=true cannot be expressed in the authors' PyTorch code, which has one r_w_bias/r_r_bias "
            "shared by all layers (their TensorFlow code and HuggingFace have per-layer biases: use export-to-hf)"
        )
    if config.layer_norm_eps != AUTHORS_LAYER_NORM_EPS:
        raise ValueError(
            f"model.layer_norm_eps={config.layer_norm_eps} cannot be expressed in the authors' PyTorch code, "
            f"whose layer norms use {AUTHORS_LAYER_NORM_EPS}"
        )


def to_original_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (tied keys included, as ``model.state_dict()`` gives it) -> the authors' ``MemTransformerLM``
    state dict, which their ``model.load_state_dict`` accepts with ``strict=True``."""
    check_expressible(config)
    original = KEY_MAP.forward(state)
    for key in _REVERSED_ROWS:
        if key in original:
            original[key] = original[key].flip(0)
    original[INV_FREQ_KEY] = sinusoid_inv_freq(config.d_model)
    return original


def from_original_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The authors' ``MemTransformerLM`` state dict -> ours (for ``TransformerXLLM(config)``, strict)."""
    check_expressible(config)
    state = dict(state)
    for key in state:
        if key.startswith(("r_emb", "r_bias")) or key == "out_layer.weight":
            raise ValueError(
                f"key {key!r}: this checkpoint is not the authors' default model (attn_type=0 with an adaptive or "
                f"full softmax); only that model is Transformer-XL's relative attention"
            )
    inv_freq = state.pop(INV_FREQ_KEY, None)
    if inv_freq is not None:
        expected = sinusoid_inv_freq(config.d_model)
        if inv_freq.shape != expected.shape or not torch.allclose(inv_freq.float().cpu(), expected, rtol=1e-3):
            raise ValueError(
                f"key {INV_FREQ_KEY!r} has shape {list(inv_freq.shape)} and does not hold the sinusoid frequencies "
                f"of d_model={config.d_model} (expected shape {list(expected.shape)}): the config does not "
                f"describe these weights"
            )
    ours = KEY_MAP.backward(state)
    for key in _REVERSED_ROWS:
        if key in ours:
            ours[key] = ours[key].flip(0)
    return ours


def load_original(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict saved by the authors' code with ``torch.save(model.state_dict(), path)``.

    Only tensors are unpickled (``weights_only=True``). A whole pickled module, which is what the authors'
    ``train.py`` writes as ``model.pt``, is refused with the command that turns it into a state dict.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: a folder, not a state dict file (.pt)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if _WEIGHTS_ONLY_REFUSAL not in str(error):  # pickle's own complaint: bytes that are no pickle
            raise _unreadable(path, error) from error
        raise ValueError(
            f"{path}: not a plain state dict; it looks like a whole pickled module (the authors' train.py saves "
            f"model.pt with torch.save(model, f)), which could run arbitrary code when loaded. On a machine where "
            f"you trust the file, with the authors' pytorch/ and pytorch/utils/ folders on PYTHONPATH, run\n"
            f"    python -c \"import torch; m = torch.load('{path.name}', map_location='cpu', weights_only=False); "
            f"torch.save(m.state_dict(), 'state_dict.pt')\"\n"
            f"and convert state_dict.pt instead. (Unpickler said: {str(error).splitlines()[0]})"
        ) from error
    except (EOFError, OSError, RuntimeError, KeyError, ValueError, IndexError) as error:
        # A truncated or damaged file: torch says "Invalid argument", "failed finding central directory", ...
        raise _unreadable(path, error) from error
    if not isinstance(loaded, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise ValueError(
            f"{path}: expected a state dict (a mapping of parameter names to tensors), got a "
            f"{type(loaded).__name__}"
            + (f" with keys {sorted(map(str, loaded))[:8]}" if isinstance(loaded, Mapping) else "")
        )
    return dict(loaded)


_WEIGHTS_ONLY_REFUSAL = "Unsupported global"
"""What torch's weights-only unpickler says of a class it refuses (a whole pickled module holds many)."""


def _unreadable(path: Path, error: BaseException) -> ValueError:
    text = str(error)
    if "WeightsUnpickler error:" in text:  # after torch's paragraph about weights_only: what it could not read
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = lines[0].split(". ")[0] if lines else type(error).__name__  # miniz's advice follows its first sentence
    return ValueError(
        f"{path}: not a readable torch checkpoint ({path.stat().st_size:,} bytes): truncated, damaged or not "
        f"written by torch.save (torch.load: {cause})"
    )


def save_original(state: Mapping[str, torch.Tensor], path: str | os.PathLike) -> Path:
    """``torch.save`` a state dict so that ``path`` is either absent or complete (written under a temporary
    name in the same folder, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = dict(state)
    return atomic_write(path, lambda handle: torch.save(state, handle))
