"""An export's config.json: the model configuration in the authors' argument names, and the tokenizer identity.

``config.json`` uses the argument names of the authors' code (``n_token``, ``n_layer``, ``n_head``, ``d_model``,
``d_head``, ``d_inner``, ``d_embed``, ``div_val``, ``cutoffs``, ``tie_weight``, ``tie_projs``, ``untie_r``,
``pre_lnorm``, ``tgt_len``, ``mem_len``, ``clamp_len``, ``same_length``, ``dropout``, ``dropatt``) with ``d_embed``
and ``tie_projs`` written out in full, plus ``attn_impl``, ``mem_dtype``, ``init_std``, ``proj_init_std``,
``layer_norm_eps``, ``"tokenizer"`` (the identity dict of `txl_dist.tokenizer.Tokenizer.identity`, or null),
``"format": "txl_dist.export"`` and ``"version": 1``. A file with only the authors' names (and no format) is
read too, with our defaults for the rest: that is the CONFIG of ``convert.py original-to-export``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from txl_dist.checkpoints.layout import COMPLETE, LATEST
from txl_dist.config.model import MODEL_FIELD_ROLES
from txl_dist.fileio import read_json
from txl_dist.model import ModelConfig
from txl_dist.run_layout import CHECKPOINTS, METRICS

FORMAT = "txl_dist.export"
VERSION = 1
CONFIG_FILE = "config.json"

AUTHORS_FIELDS = MODEL_FIELD_ROLES.authors
"""The fields of config.json named as in the authors' code; all are required when reading. Derived from the
`Roles` of ModelConfig's fields, as are the two below."""
EXTRA_FIELDS = MODEL_FIELD_ROLES.extra
"""Our fields the authors' code does not have; ModelConfig's defaults when absent."""
EVAL_SETTINGS = MODEL_FIELD_ROLES.segment
"""The fields `load_model` may override: none of them changes what the weights mean."""
IDENTITY_KEYS = ("kind", "vocab_size", "fingerprint", "eos_id", "eod_id", "unk_id")
"""The keys of a tokenizer identity (`txl_dist.tokenizer.Tokenizer.identity`)."""


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; FileNotFoundError or ValueError in one line naming the file (``what``: what
    the file is, for the message when it is missing)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what})")
    return read_json(path, expect_object=True)


def config_to_json(config: ModelConfig, tokenizer: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The content of config.json for ``config`` and a tokenizer identity (or None)."""
    fields = config.resolved_dict()
    data: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    data.update({name: fields[name] for name in AUTHORS_FIELDS + EXTRA_FIELDS})
    data["tokenizer"] = dict(tokenizer) if tokenizer is not None else None
    return data


def config_from_json(data: Mapping[str, Any], where: str) -> tuple[ModelConfig, dict[str, Any] | None]:
    """(ModelConfig, tokenizer identity or None) from the content of a config.json; ``where`` names it in errors."""
    data = dict(data)
    file_format = data.pop("format", FORMAT)
    version = data.pop("version", VERSION)
    if file_format != FORMAT:
        raise ValueError(f"{where}: key 'format' is {file_format!r}, expected {FORMAT!r}")
    if version != VERSION:
        raise ValueError(f"{where}: key 'version' is {version!r}; this txl_dist reads version {VERSION}")
    tokenizer = data.pop("tokenizer", None)
    if tokenizer is not None:
        if not isinstance(tokenizer, dict) or any(key not in tokenizer for key in IDENTITY_KEYS):
            raise ValueError(f"{where}: key 'tokenizer' must be null or an object with the keys {list(IDENTITY_KEYS)}")
    missing = [name for name in AUTHORS_FIELDS if name not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing} (config.json names every field of the authors' code)")
    if data["d_embed"] == -1:  # the authors' command line spells "d_embed = d_model" as -1
        data["d_embed"] = None
    return ModelConfig.from_dict(data, where=where), tokenizer


def _training_folder_kind(folder: Path) -> str | None:
    """What training wrote ``folder`` as: a run folder, its checkpoints folder, one checkpoint; None otherwise."""
    if (folder / CHECKPOINTS).is_dir() or (folder / METRICS).is_file():
        return "a training run folder"
    if (folder / LATEST).is_file():
        return "a training run's checkpoints folder"
    if (folder / COMPLETE).is_file():
        return "a training checkpoint"
    return None


def require_export_folder(export_dir: str | os.PathLike) -> None:
    """FileNotFoundError or ValueError, in one line, for a path that is no export folder: missing, a file, or a
    folder of training (its run, checkpoints or one checkpoint), for which the message gives the command that
    exports it. A folder without config.json that is none of those is left to the reader of config.json."""
    export_dir = Path(export_dir)
    if not export_dir.exists():
        raise FileNotFoundError(f"{export_dir}: no such export folder")
    if not export_dir.is_dir():
        raise ValueError(f"{export_dir}: a file, not an export folder (launchers/convert.py zero-to-export writes one)")
    kind = None if (export_dir / CONFIG_FILE).exists() else _training_folder_kind(export_dir)
    if kind is not None:
        raise ValueError(
            f"{export_dir}: {kind}, not an export folder (no {CONFIG_FILE}); export it first: python "
            f"launchers/convert.py zero-to-export {export_dir} EXPORT_DIR"
        )


def read_config_file(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any] | None]:
    """(ModelConfig, tokenizer identity or None) from a config.json file (an export's, or one written by hand
    with the authors' argument names)."""
    path = Path(path)
    return config_from_json(read_json_object(path, "the model configuration"), where=str(path))


def read_export_config(export_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of an export folder (`require_export_folder` first)."""
    require_export_folder(export_dir)
    return read_config_file(Path(export_dir) / CONFIG_FILE)[0]


def apply_eval_overrides(config: ModelConfig, overrides: Mapping[str, Any]) -> ModelConfig:
    """``config`` with evaluation settings changed (a None value keeps the exported one). Raises ValueError naming
    a field that would change the meaning of the weights."""
    allowed = {name: value for name, value in overrides.items() if value is not None}
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for name in allowed:
        if name not in EVAL_SETTINGS:
            if name in names:
                raise ValueError(
                    f"{name} cannot be overridden when loading an export: it fixes the shapes or the "
                    f"meaning of the weights (evaluation settings are {list(EVAL_SETTINGS)})"
                )
            raise ValueError(f"unknown setting {name!r}; evaluation settings are {list(EVAL_SETTINGS)}")
    return dataclasses.replace(config, **allowed).validate()
