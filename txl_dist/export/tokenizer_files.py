"""An export's tokenizer/ folder: the tokenizer's files copied unchanged, checked against the identity recorded.

The folder holds the files its ``tokenizer.json`` lists and that ``tokenizer.json``; their fingerprint must be the
one ``tokenizer.json`` records, and that identity the one config.json records (`load_export_tokenizer`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from txl_dist.export.config_file import CONFIG_FILE, IDENTITY_KEYS, read_config_file, read_json_object
from txl_dist.tokenizer import fingerprint_files, load_tokenizer

if TYPE_CHECKING:
    from txl_dist.tokenizer import Tokenizer

TOKENIZER_DIR = "tokenizer"
TOKENIZER_JSON = "tokenizer.json"


def tokenizer_files(directory: Path) -> tuple[list[str], dict[str, Any]]:
    """The file names tokenizer.json lists, and the identity it records (its fingerprint checked against them)."""
    path = directory / TOKENIZER_JSON
    description = read_json_object(path, "the tokenizer description")
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


def check_same_tokenizer(
    recorded: Mapping[str, Any], found: Mapping[str, Any], recorded_where: str, found_where: str
) -> None:
    """ValueError naming the first key of the identity ``found`` that differs from the ``recorded`` one."""
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


def tokenizer_to_export(
    tokenizer_dir: Path | None, identity: Mapping[str, Any] | None, n_token: int
) -> tuple[dict[str, Any] | None, list[str]]:
    """(the identity config.json records, the files to copy) for `write_export`: the directory's identity,
    checked against a checkpoint's ``identity`` when there is one, else that identity alone; either must have
    ``vocab_size`` equal to the model's ``n_token``."""
    identity = dict(identity) if identity is not None else None
    files: list[str] = []
    if tokenizer_dir is not None:
        files, found = tokenizer_files(tokenizer_dir)
        if identity is not None:
            check_same_tokenizer(identity, found, "the checkpoint", str(tokenizer_dir))
        identity = found
    if identity is not None and identity.get("vocab_size") != n_token:
        raise ValueError(
            f"tokenizer mismatch: the tokenizer has vocab_size={identity.get('vocab_size')}, but the "
            f"model has n_token={n_token}"
        )
    return identity, files


def copy_tokenizer(tokenizer_dir: Path, files: list[str], folder: Path) -> None:
    """Copy the tokenizer's ``files`` and its tokenizer.json into ``folder/tokenizer/``, checking the copies."""
    (folder / TOKENIZER_DIR).mkdir()
    for name in files + [TOKENIZER_JSON]:
        shutil.copyfile(tokenizer_dir / name, folder / TOKENIZER_DIR / name)
    tokenizer_files(folder / TOKENIZER_DIR)  # the copies hash to the recorded fingerprint


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
    _, found = tokenizer_files(folder)
    check_same_tokenizer(recorded, found, str(config_path), str(folder))
    if found["vocab_size"] != config.n_token:
        raise ValueError(
            f"tokenizer mismatch: {folder} has vocab_size={found['vocab_size']}, but {config_path} "
            f"has n_token={config.n_token}"
        )
    return load_tokenizer(folder)
