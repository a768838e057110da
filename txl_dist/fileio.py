"""Small file helpers shared by the tokenizer, the shard builder and their readers."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Sequence


def sha256_files(paths: Sequence[str | os.PathLike], block_bytes: int = 1 << 22) -> str:
    """Hex sha256 of the files' bytes one after another, read in blocks (memory does not grow with the files)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(block_bytes):
                digest.update(block)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of one file's bytes (what ``sha256sum`` prints)."""
    return sha256_files([path])


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Create ``path`` through ``write(binary file)`` so that a reader sees the old file or the whole new one,
    never a part: the bytes go to a temporary file in the same folder, which is synced and renamed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600); give it the permissions of a file created with open(), so that
        # the other accounts of a shared cluster can read what a run wrote.
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of UTF-8 text (``\\n`` line ends on every platform)."""
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))
