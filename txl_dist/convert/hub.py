"""An export folder -> a folder that current transformers (5.x) loads with its own classes and remote code.

    OUT/
      config.json               TransformerXLConfig: the architecture in the authors' names, auto_map to the code
      configuration_txl.py      the configuration class      } self-contained: torch and transformers only,
      modeling_txl.py           the models                   } written by txl_dist (txl_dist/convert/hub_files/)
      memory_txl.py             the memory (the cache)       }
      attention_txl.py          the decoder layer            }
      adaptive_txl.py           adaptive embedding, softmax  }
      model.safetensors         the weights under the modeling file's names; each tied tensor once
      generation_config.json    the eod token as bos / eos / pad (a generated document ends at eod)
      tokenizer.json            the tokenizer as a `tokenizers` fast tokenizer (see txl_dist.convert.fast_tokenizer)
      tokenizer_config.json

Loading needs nothing but transformers:

    model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(OUT)

The weight map is explicit (`KEY_MAP`). The modeling file keeps txl_dist's module names; the decoder sits under
``transformer.`` and every projection matrix is a module's ``weight`` (transformers ties parameters named so).
Tied tensors (``tie_weight``, ``tie_projs``) are stored once, under the embedding's name, and listed by the model
for transformers to tie after loading.

Like the other conversions, the folder is written under a temporary name beside OUT and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file

from txl_dist.config.model import MODEL_FIELD_ROLES, ModelConfig
from txl_dist.convert.fast_tokenizer import fast_tokenizer_files
from txl_dist.convert.keymap import KeyMap
from txl_dist.export import (
    CONFIG_FILE,
    load_export_tokenizer,
    load_model,
    read_config_file,
    require_export_folder,
    unique_weights,
)
from txl_dist.export.config_file import read_json_object
from txl_dist.export.weights import save_safetensors
from txl_dist.output_folders import check_output_path, staged_output

HUB_FILES = Path(__file__).with_name("hub_files")
MODELING_FILES = ("configuration_txl.py", "modeling_txl.py", "memory_txl.py", "attention_txl.py", "adaptive_txl.py")
MODEL_TYPE = "txl_dist_transformer_xl"
ARCHITECTURE = "TransformerXLForCausalLM"
AUTO_MAP = {
    "AutoConfig": "configuration_txl.TransformerXLConfig",
    "AutoModel": "modeling_txl.TransformerXLModel",
    "AutoModelForCausalLM": "modeling_txl.TransformerXLForCausalLM",
}
WEIGHTS_FILE = "model.safetensors"

# Our keys -> the modeling file's keys.
KEY_MAP = KeyMap(
    [
        ("word_emb.emb_layers.{i}.weight", "transformer.word_emb.emb_layers.{i}.weight"),
        ("word_emb.emb_projs.{i}", "transformer.word_emb.emb_projs.{i}.weight"),
        ("r_{which}_bias", "transformer.r_{which}_bias"),
        ("layers.{rest}", "transformer.layers.{rest}"),
        ("crit.out_layers.{rest}", "crit.out_layers.{rest}"),
        ("crit.out_projs.{i}", "crit.out_projs.{i}.weight"),
        ("crit.cluster_{which}", "crit.cluster_{which}"),
    ],
    source_name="txl_dist",
    target_name="modeling_txl",
)


def hub_config(config: ModelConfig, tokenizer_identity: dict[str, Any] | None) -> dict[str, Any]:
    """config.json of the folder (what TransformerXLConfig reads)."""
    data: dict[str, Any] = {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], "auto_map": dict(AUTO_MAP)}
    fields = config.resolved_dict()
    data.update({name: fields[name] for name in MODEL_FIELD_ROLES.hub})  # the fields with a hub_key, in its order
    has_projections = config.div_val > 1 or config.d_embed_resolved != config.d_model
    data["tie_word_embeddings"] = bool(config.tie_weight or (has_projections and any(config.tie_projs_resolved)))
    data["use_cache"] = True
    if tokenizer_identity is not None:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            data[name] = tokenizer_identity["eod_id"]
    data["txl_dist_tokenizer"] = tokenizer_identity
    return data


def hub_weights(state: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """Our state dict -> the modeling file's keys, each tied tensor once (under the embedding's name)."""
    return {
        key: tensor.detach().contiguous().clone()
        for key, tensor in KEY_MAP.forward(unique_weights(state, config)).items()
    }


def write_hub_folder(
    export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False, verify: bool = True
) -> Path:
    """An export folder -> a folder for current transformers (see the module docstring); returns its path."""
    export_dir = Path(export_dir)
    out_dir = check_output_path(out_dir, [export_dir], overwrite=overwrite)
    require_export_folder(export_dir)
    config, identity = read_config_file(export_dir / CONFIG_FILE)
    tokenizer = load_export_tokenizer(export_dir)
    tokenizer_files = fast_tokenizer_files(tokenizer) if tokenizer is not None else {}
    weights = hub_weights(load_model(export_dir, verify=verify).state_dict(), config)
    texts = {"config.json": hub_config(config, identity)}
    # The dtype the weights are stored in (transformers loads them so by default).
    texts["config.json"]["dtype"] = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    if tokenizer is not None:
        eod = tokenizer.eod_id
        texts["generation_config.json"] = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}
    texts.update(tokenizer_files)

    with staged_output(out_dir, "txl_dist.convert.hub.write_hub_folder") as staging:
        save_safetensors(weights, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        for name in MODELING_FILES:
            shutil.copyfile(HUB_FILES / name, staging / name)
        for name, content in texts.items():
            (staging / name).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir


def read_hub_config(hub_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any] | None]:
    """(config, tokenizer identity or None) of a folder `write_hub_folder` wrote, from its config.json."""
    path = Path(hub_dir) / "config.json"
    data = read_json_object(path, "not a model folder of export-to-hub")
    if data.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{path}: model_type is {data.get('model_type')!r}, expected {MODEL_TYPE!r}")
    missing = [name for name in MODEL_FIELD_ROLES.hub if name not in data]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    config = ModelConfig.from_dict({name: data[name] for name in MODEL_FIELD_ROLES.hub}, where=str(path))
    return config, data.get("txl_dist_tokenizer")


def read_hub_weights(hub_dir: str | os.PathLike, config: ModelConfig) -> dict[str, Any]:
    """Our state dict (each tied tensor once) from the folder's model.safetensors."""
    path = Path(hub_dir) / WEIGHTS_FILE
    try:
        stored = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
    return unique_weights(KEY_MAP.backward(stored), config, str(path))
