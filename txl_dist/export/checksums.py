"""An export's checksums.json: every file's size and CRC-32, written last and verified before a load.

The checks are the checkpoints' (txl_dist.checkpoints.verify). Loading verifies the files against
``checksums.json`` first (`require_verified_export`; ``verify=False`` skips it). A folder written before exports
carried checksums loads with a warning that it is unverified. Files added later (evaluate.py's
``eval_{split}.json``) are not listed and not checked.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from txl_dist.checkpoint_paths import FILES_KEY
from txl_dist.checkpoints.verify import check_files
from txl_dist.export.config_file import require_export_folder
from txl_dist.fileio import CHECKSUM_NAME, FileChecksum, atomic_write_text, file_checksum

CHECKSUMS_FILE = "checksums.json"
CHECKSUMS_FORMAT = "txl_dist.export-checksums"

log = logging.getLogger("txl_dist.export")


class ExportVerificationError(ValueError):
    """An export folder whose files do not match its checksums.json; the message lists every problem."""


def write_checksums(folder: str | os.PathLike) -> None:
    """``checksums.json`` of a folder being written: every file in it (sub-folders included), size and CRC-32."""
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
    export_dir = Path(export_dir)
    path = export_dir / CHECKSUMS_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("checksum") != CHECKSUM_NAME:
            algorithm = record.get("checksum")
            return [f"{path}: checksum {algorithm!r} is not one that txl_dist checks (it records {CHECKSUM_NAME!r})"]
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
    warn (once, here) when the folder has none. A path that is no export folder (`require_export_folder`) is
    refused first, verified or not. ``verify`` False: nothing is checked (the caller says so)."""
    require_export_folder(export_dir)
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
