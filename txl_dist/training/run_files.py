"""A run's log files (metrics.jsonl, the TensorBoard event file) are written for the whole run: a path that no
longer names the open file (the file or its folder removed or replaced by a user or a cleanup job) is found at the
next flush, instead of the run writing on into a file nobody can see. Used by `run_logger` and
`tensorboard_events`, which both import it (neither imports the other for it)."""

from __future__ import annotations

import os
from pathlib import Path


class FileGone(RuntimeError):
    """A file's path no longer names the file being written (it or its folder was removed or replaced)."""


def file_identity(handle) -> tuple[int, int]:
    """(device, inode) of an open file."""
    status = os.fstat(handle.fileno())
    return status.st_dev, status.st_ino


def require_same_file(path: Path, identity: tuple[int, int]) -> None:
    """FileGone unless ``path`` still names the file of ``identity`` (`file_identity` of the open file)."""
    try:
        status = os.stat(path)
        same = (status.st_dev, status.st_ino) == identity
    except (FileNotFoundError, NotADirectoryError):  # removed, or its folder replaced by a file
        same = False
    if not same:
        raise FileGone(f"{path}: removed or replaced while the run was writing it")
