"""The export folder: a trained model in a form that evaluation, generation and other libraries read.

    OUT/
      config.json          the architecture in the authors' argument names, our settings, the tokenizer identity
      model.safetensors    the weights; each tied tensor once
      tokenizer/           (optional) the tokenizer's files and its tokenizer.json, copied unchanged
      training.json        (optional) where the weights come from: step, tokens seen, evaluation results
      checksums.json       every file above with its size and CRC-32, written last (as a checkpoint's COMPLETE.json)

``config.json`` uses the argument names of the authors' code (``n_token``, ``n_layer``, ``n_head``, ``d_model``,
``d_head``, ``d_inner``, ``d_embed``, ``div_val``, ``cutoffs``, ``tie_weight``, ``tie_projs``, ``untie_r``,
``pre_lnorm``, ``tgt_len``, ``mem_len``, ``clamp_len``, ``same_length``, ``dropout``, ``dropatt``) with ``d_embed``
and ``tie_projs`` written out in full, plus ``attn_impl``, ``mem_dtype``, ``init_std``, ``proj_init_std``,
``layer_norm_eps``, ``"tokenizer"`` (the identity dict of `txl_dist.tokenizer.Tokenizer.identity`, or null),
``"format": "txl_dist.export"`` and ``"version": 1``. A file with only the authors' names (and no format) is
read too, with our defaults for the rest: that is the CONFIG of ``convert.py original-to-export``.

safetensors refuses tensors that share memory, so a tied tensor (``crit.out_layers.i.weight`` with
``tie_weight``, ``crit.out_projs.i`` with ``tie_projs``) is stored under its embedding's name only, and the
file's metadata lists the ties (``txl_dist.tied``: alias -> stored name); loading checks them against the
config and ties them again.

An export is written into a temporary folder next to OUT and renamed into place, so OUT is never half written.
Loading verifies the files against ``checksums.json`` first (`require_verified_export`; ``verify=False`` skips
it), and refuses weights that hold NaN or infinity, naming the tensors (`require_finite`). A folder written before
exports carried checksums loads with a warning that it is unverified. Files added later (evaluate.py's
``eval_{split}.json``) are not listed and not checked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from txl_dist.fileio import (
    CHECKSUM_NAME,
    FileChecksum,
    atomic_write_text,
    check_output_path,
    file_checksum,
    staged_output,
)
from txl_dist.model import ModelConfig, TransformerXLLM
from txl_dist.tokenizer import fingerprint_files

if TYPE_CHECKING:
    from txl_dist.tokenizer import Tokenizer

FORMAT = "txl_dist.export"
VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_JSON = "tokenizer.json"
TRAINING_FILE = "training.json"
TIED_METADATA_KEY = "txl_dist.tied"
CHECKSUMS_FILE = "checksums.json"
CHECKSUMS_FORMAT = "txl_dist.export-checksums"

log = logging.getLogger("txl_dist.export")

AUTHORS_FIELDS = (
    "n_token",
    "n_layer",
    "n_head",
    "d_model",
    "d_head",
    "d_inner",
    "d_embed",
    "div_val",
    "cutoffs",
    "tie_weight",
    "tie_projs",
    "untie_r",
    "pre_lnorm",
    "tgt_len",
    "mem_len",
    "clamp_len",
    "same_length",
    "dropout",
    "dropatt",
)
"""The fields of config.json named as in the authors' code; all are required when reading."""
EXTRA_FIELDS = ("attn_impl", "mem_dtype", "init_std", "proj_init_std", "layer_norm_eps")
"""Our fields the authors' code does not have; ModelConfig's defaults when absent."""
EVAL_SETTINGS = ("tgt_len", "mem_len", "clamp_len", "same_length", "attn_impl", "mem_dtype", "dropout", "dropatt")
"""The fields `load_model` may override: none of them changes what the weights mean."""
IDENTITY_KEYS = ("kind", "vocab_size", "fingerprint", "eos_id", "eod_id", "unk_id")


# ---------------------------------------------------------------------------------------------------------------
# config.json


def config_to_json(config: ModelConfig, tokenizer: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The content of config.json for ``config`` and a tokenizer identity (or None)."""
    fields = config.to_dict()
    fields["d_embed"] = config.d_embed_resolved
    fields["tie_projs"] = config.tie_projs_resolved
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


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing ({what})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error


def read_config_file(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any] | None]:
    """(ModelConfig, tokenizer identity or None) from a config.json file (an export's, or one written by hand
    with the authors' argument names)."""
    path = Path(path)
    data = _read_json(path, "the model configuration")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config_from_json(data, where=str(path))


def read_export_config(export_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of an export folder."""
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


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer files


def _tokenizer_files(directory: Path) -> tuple[list[str], dict[str, Any]]:
    """The file names tokenizer.json lists, and the identity it records (its fingerprint checked against them)."""
    path = directory / TOKENIZER_JSON
    description = _read_json(path, "the tokenizer description")
    if not isinstance(description, dict):
        raise ValueError(f"{path}: expected a JSON object")
    missing = [key for key in IDENTITY_KEYS + ("files",) if key not in description]
    if missing:
        raise ValueError(f"{path}: missing key(s) {missing}")
    files = description["files"]
    if (
        not isinstance(files, list)
        or not files
        or any(not isinstance(name, str) or Path(name).name != name or name == TOKENIZER_JSON for name in files)
    ):
        raise ValueError(f"{path}: key 'files' must list the names of the tokenizer's files, got {files!r}")
    for name in files:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name}: missing tokenizer file (listed in {path})")
    actual = fingerprint_files(directory, files)
    if actual != description["fingerprint"]:
        raise ValueError(
            f"{directory}: the files {files} have fingerprint {actual}, but {path} records "
            f"{description['fingerprint']}; they changed after the tokenizer was made"
        )
    return files, {key: description[key] for key in IDENTITY_KEYS}


def _check_same_tokenizer(
    recorded: Mapping[str, Any], found: Mapping[str, Any], recorded_where: str, found_where: str
) -> None:
    if recorded["fingerprint"] != found["fingerprint"]:
        raise ValueError(
            f"tokenizer mismatch: {recorded_where} records fingerprint {recorded['fingerprint']}, "
            f"but {found_where} has fingerprint {found['fingerprint']}"
        )
    for key in IDENTITY_KEYS:
        if recorded[key] != found[key]:
            raise ValueError(
                f"tokenizer mismatch: {recorded_where} records {key}={recorded[key]!r}, "
                f"but {found_where} has {key}={found[key]!r}"
            )


# ---------------------------------------------------------------------------------------------------------------
# Weights


def _layout(config: ModelConfig) -> tuple[dict[str, torch.Size], dict[str, str]]:
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


def _check_keys_and_shapes(state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], where: str) -> None:
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
    shapes, aliases = _layout(config)
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
    _check_keys_and_shapes(state, {k: s for k, s in shapes.items() if k not in aliases}, where)
    return state


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that owns exactly its bytes (what safetensors stores)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


# ---------------------------------------------------------------------------------------------------------------
# Verification: every file's size and CRC-32, with the checkpoints' machinery (txl_dist.training.checkpoint_verify)


class ExportVerificationError(ValueError):
    """An export folder whose files do not match its checksums.json; the message lists every problem."""


def write_checksums(folder: str | os.PathLike) -> None:
    """``checksums.json`` of a folder being written: every file in it (sub-folders included), size and CRC-32."""
    from txl_dist.training.checkpoint_layout import FILES_KEY

    folder = Path(folder)
    files = {
        path.relative_to(folder).as_posix(): file_checksum(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != CHECKSUMS_FILE
    }
    record = {
        "format": CHECKSUMS_FORMAT,
        "checksum": CHECKSUM_NAME,
        FILES_KEY: {name: checksum.to_json() for name, checksum in files.items()},
    }
    atomic_write_text(folder / CHECKSUMS_FILE, json.dumps(record, indent=1) + "\n")


def verify_export(export_dir: str | os.PathLike) -> list[str] | None:
    """Every problem of an export folder's files against its checksums.json (an empty list: it verifies), each
    naming the file; None when the folder has no checksums.json (written before exports carried checksums)."""
    from txl_dist.training.checkpoint_layout import FILES_KEY
    from txl_dist.training.checkpoint_verify import check_files

    export_dir = Path(export_dir)
    path = export_dir / CHECKSUMS_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("checksum") != CHECKSUM_NAME:
            raise ValueError(f"checksum {record.get('checksum')!r}, expected {CHECKSUM_NAME!r}")
        expected = {name: FileChecksum.from_json(entry) for name, entry in record[FILES_KEY].items()}
    except (
        OSError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        AttributeError,
        KeyError,
        TypeError,
        ValueError,
    ) as error:
        return [f"{path}: unreadable ({error})"]
    return check_files(export_dir, expected, threads=min(8, os.cpu_count() or 1), marker=CHECKSUMS_FILE)


def require_verified_export(export_dir: str | os.PathLike, verify: bool = True) -> None:
    """Raise `ExportVerificationError` listing every file of ``export_dir`` that does not match its checksums.json;
    warn (once, here) when the folder has none. ``verify`` False: nothing is checked (the caller says so)."""
    if not verify:
        return
    problems = verify_export(export_dir)
    if problems is None:
        log.warning(
            "%s: no %s (an export written before txl_dist checksummed its exports): its files are not verified",
            export_dir,
            CHECKSUMS_FILE,
        )
    elif problems:
        raise ExportVerificationError(
            f"{export_dir} fails verification: {'; '.join(problems)} (--no-verify, or verify=False, reads it anyway)"
        )


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


# ---------------------------------------------------------------------------------------------------------------
# Writing and reading an export


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
    """Write an export folder (see the module docstring) and return its path.

    ``tokenizer_dir``: a tokenizer directory (its ``tokenizer.json`` lists the files) to copy into
    ``OUT/tokenizer/``; ``tokenizer_identity``: the identity a checkpoint recorded, checked against that
    directory, or recorded alone when there is none. Either must agree with ``config.n_token``.
    ``training_info``: free-form JSON for ``training.json``. An existing ``out_dir`` is an error unless
    ``overwrite``, which replaces only an empty folder or one that txl_dist wrote
    (`txl_dist.fileio.check_output_path`).
    """
    out_dir = check_output_path(out_dir, overwrite=overwrite)
    if isinstance(model_or_state_dict, nn.Module):
        model_config = getattr(model_or_state_dict, "config", None)
        if isinstance(model_config, ModelConfig) and model_config.architecture() != config.architecture():
            raise ValueError(
                f"the model's architecture {model_config.architecture()} differs from the config's "
                f"{config.architecture()}"
            )
        state = model_or_state_dict.state_dict()
    else:
        state = model_or_state_dict
    weights = {key: _standalone(value) for key, value in unique_weights(state, config).items()}
    require_finite(weights, "the weights to export")
    _, aliases = _layout(config)

    identity = dict(tokenizer_identity) if tokenizer_identity is not None else None
    tokenizer_files: list[str] = []
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        tokenizer_files, found = _tokenizer_files(tokenizer_dir)
        if identity is not None:
            _check_same_tokenizer(identity, found, "the checkpoint", str(tokenizer_dir))
        identity = found
    if identity is not None and identity.get("vocab_size") != config.n_token:
        raise ValueError(
            f"tokenizer mismatch: the tokenizer has vocab_size={identity.get('vocab_size')}, but the "
            f"model has n_token={config.n_token}"
        )
    config_text = json.dumps(config_to_json(config, identity), indent=1) + "\n"
    training_text = json.dumps(dict(training_info), indent=1) + "\n" if training_info is not None else None

    with staged_output(out_dir, "txl_dist.export.write_export") as staging:
        save_safetensors(
            weights,
            staging / WEIGHTS_FILE,
            metadata={"format": "pt", TIED_METADATA_KEY: json.dumps(aliases, sort_keys=True)},
        )
        if tokenizer_dir is not None:
            (staging / TOKENIZER_DIR).mkdir()
            for name in tokenizer_files + [TOKENIZER_JSON]:
                shutil.copyfile(tokenizer_dir / name, staging / TOKENIZER_DIR / name)
            _tokenizer_files(staging / TOKENIZER_DIR)  # the copies hash to the recorded fingerprint
        if training_text is not None:
            (staging / TRAINING_FILE).write_text(training_text, encoding="utf-8")
        # Last: a folder with config.json and no weights never exists, even inside the staging folder.
        (staging / CONFIG_FILE).write_text(config_text, encoding="utf-8")
        write_checksums(staging)
    return out_dir


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, whose I/O failures (no space left, ...) become the OSError they are."""
    try:
        save_file(dict(tensors), str(path), metadata=metadata)
    except SafetensorError as error:
        code = re.search(r"os error (\d+)", str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from error


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
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path}: missing (the weights of the export)")
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(weights_path), device=str(device))
    except SafetensorError as error:
        raise ValueError(f"{weights_path}: not a readable safetensors file ({error})") from error
    shapes, aliases = _layout(config)
    recorded_aliases = json.loads(metadata.get(TIED_METADATA_KEY, "{}"))
    if recorded_aliases != aliases:
        raise ValueError(
            f"{weights_path}: stored with the ties {recorded_aliases}, but {export_dir / CONFIG_FILE} "
            f"(tie_weight, tie_projs) gives {aliases}"
        )
    _check_keys_and_shapes(tensors, {k: s for k, s in shapes.items() if k not in aliases}, str(weights_path))
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
    _, aliases = _layout(config)
    with torch.device(device):
        model = TransformerXLLM(config)
    model.load_state_dict({**weights, **{alias: weights[stored] for alias, stored in aliases.items()}}, strict=True)
    return model.eval()


def load_export_tokenizer(export_dir: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of an export folder, checked against the identity config.json records; None when the export
    records no tokenizer."""
    export_dir = Path(export_dir)
    config_path = export_dir / CONFIG_FILE
    config, recorded = read_config_file(config_path)
    folder = export_dir / TOKENIZER_DIR
    if recorded is None:
        if folder.exists():
            raise ValueError(f"{folder}: present, but {config_path} records no tokenizer (key 'tokenizer' is null)")
        return None
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: missing, but {config_path} records a tokenizer (fingerprint "
            f"{recorded['fingerprint']}); copy that tokenizer's directory there"
        )
    _, found = _tokenizer_files(folder)
    _check_same_tokenizer(recorded, found, str(config_path), str(folder))
    if found["vocab_size"] != config.n_token:
        raise ValueError(
            f"tokenizer mismatch: {folder} has vocab_size={found['vocab_size']}, but {config_path} "
            f"has n_token={config.n_token}"
        )
    from txl_dist.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def load_pretrained(
    export_dir: str | os.PathLike, *, device: str | torch.device = "cpu", verify: bool = True, **overrides: Any
) -> tuple[TransformerXLLM, Tokenizer | None]:
    """(model in eval mode, tokenizer or None) of an export folder; ``overrides`` and ``verify`` as in
    `load_model` (the files are verified before any is read)."""
    require_verified_export(export_dir, verify)
    tokenizer = load_export_tokenizer(export_dir)
    return load_model(export_dir, device=device, verify=False, **overrides), tokenizer
