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

from txl_dist.checkpoint_paths import COMPLETE, LATEST
from txl_dist.config.model import MODEL_FIELD_ROLES
from txl_dist.data.format import MANIFEST_NAME
from txl_dist.export.weights import WEIGHTS_FILE
from txl_dist.fileio import read_json
from txl_dist.model import ModelConfig
from txl_dist.run_paths import CHECKPOINTS, METRICS
from txl_dist.tokenizer.base import BYTE_VOCAB, CHAR_VOCAB, SENTENCEPIECE_MODEL, TOKENIZER_JSON, WORD_VOCAB

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


EXPORT_COMMAND = "python launchers/convert.py zero-to-export RUN_DIR EXPORT_DIR"
"""The command that writes an export folder from a training run (its folder, checkpoints folder or checkpoint)."""
TOKENIZER_FILES = (TOKENIZER_JSON, WORD_VOCAB, SENTENCEPIECE_MODEL, BYTE_VOCAB, CHAR_VOCAB)
"""The files that make a folder a tokenizer's (data_tools/train_tokenizer.py writes them)."""
EXPORT_FILES = (WEIGHTS_FILE, "checksums.json", "training.json")
"""An export's files besides config.json (`txl_dist.export.checksums.CHECKSUMS_FILE`, `folder.TRAINING_FILE`,
which import this module): a folder with one of them is an export that lost its config.json."""
HUB_MODEL_TYPE = "txl_dist_transformer_xl"
"""The model_type of the config.json that ``convert.py export-to-hub`` writes."""


def describe_folder(folder: Path) -> str | None:
    """What a folder that holds no model is, in words ("a shards folder (manifest.json)", "the tokenizer folder
    of the export E"); None when nothing in it says."""
    kind = _training_folder_kind(folder)
    if kind is not None:
        return kind
    if (folder / MANIFEST_NAME).is_file():
        return f"a shards folder ({MANIFEST_NAME})"
    found = next((name for name in TOKENIZER_FILES if (folder / name).is_file()), None)
    if found and (folder.parent / CONFIG_FILE).is_file():
        return f"the tokenizer folder of the export {folder.parent}"
    return f"a tokenizer folder ({found})" if found else None


def _not_an_export(folder: Path) -> str | None:
    """The one line saying what ``folder`` (a folder) is when it is not an export folder, and what to give
    instead; None when it may be one (a config.json that is not a transformers folder's: its reader judges it)."""
    if not (folder / CONFIG_FILE).exists():
        if any((folder / name).exists() for name in EXPORT_FILES):  # an export that lost it: its reader says so
            return None
        kind = _training_folder_kind(folder)
        if kind is not None:
            return (
                f"{folder}: {kind}, not an export folder (no {CONFIG_FILE}); export it first: python "
                f"launchers/convert.py zero-to-export {folder} EXPORT_DIR"
            )
        if (folder / MANIFEST_NAME).is_file():
            kind = f"a shards folder ({MANIFEST_NAME})"
        elif (folder.parent / CONFIG_FILE).is_file() and any((folder / name).is_file() for name in TOKENIZER_FILES):
            export = folder.parent
            return f"{folder}: the tokenizer folder of the export {export}, not an export folder: give {export}"
        else:
            found = next((name for name in TOKENIZER_FILES if (folder / name).is_file()), None)
            kind = f"a tokenizer folder ({found})" if found else None
        what = f"{kind}, not an export folder" if kind else "not an export folder"
        return f"{folder}: {what} (no {CONFIG_FILE}): give an export folder, which {EXPORT_COMMAND} writes"
    try:
        model_type = read_json(folder / CONFIG_FILE, expect_object=True).get("model_type")
    except (OSError, ValueError):  # its reader says what is wrong with it
        return None
    if model_type is None:
        return None
    if model_type == HUB_MODEL_TYPE:
        written = "convert.py export-to-hub writes for transformers 5"
    else:
        written = f"config.json's model_type is {model_type!r}; convert.py export-to-hf writes those"
    return (
        f"{folder}: a folder for Hugging Face transformers ({written}), not a txl_dist export folder: give the "
        "export folder it was converted from, or load it with transformers"
    )


def require_export_folder(export_dir: str | os.PathLike) -> None:
    """FileNotFoundError or ValueError, in one line, for a path that is no export folder: missing, a file, or a
    folder of something else, named: a training run (its run, checkpoints or one checkpoint, for which the
    message gives the command that exports it), shards, a tokenizer (an export's own: the export is named), a
    transformers folder of export-to-hf or export-to-hub, or a folder without config.json. Called before the
    checksums are verified, so that such a folder is never warned about as an export without checksums.json."""
    export_dir = Path(export_dir)
    if not export_dir.exists():
        raise FileNotFoundError(f"{export_dir}: no such export folder")
    if not export_dir.is_dir():
        raise ValueError(f"{export_dir}: a file, not an export folder (launchers/convert.py zero-to-export writes one)")
    problem = _not_an_export(export_dir)
    if problem is not None:
        raise ValueError(problem)


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
