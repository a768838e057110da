"""Small file helpers shared by the tokenizer, the shard builder and their readers."""

from __future__ import annotations

import hashlib
import os
import secrets
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
    never a part: the bytes go to a temporary file in the same folder, which is synced and renamed. On any
    failure, Ctrl-C included, the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            # Mode 0666 less the umask, as open() gives: the other accounts of a shared cluster can read the file.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:  # somebody else's file of that name: not ours to remove
            continue
        except BaseException:
            # Removed by name: an interrupt can arrive after the file was created and before `fd` was set.
            tmp.unlink(missing_ok=True)
            raise
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of UTF-8 text (``\\n`` line ends on every platform)."""
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))
