"""Small file helpers shared by the tokenizer, the shard builder, checkpoints and conversions: checksums, atomic
writes, write failures in one line, and outputs that never destroy an input."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO


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
    failure, Ctrl-C included, the temporary file is removed and ``path`` is left as it was; an OSError (no space,
    read-only, ...) names ``path``."""
    path = Path(path)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            # Mode 0666 less the umask, as open() gives: the other accounts of a shared cluster can read the file.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:  # somebody else's file of that name: not ours to remove
            continue
        except BaseException as error:
            # Removed by name: an interrupt can arrive after the file was created and before `fd` was set.
            _remove_quietly(tmp)
            if isinstance(error, OSError):
                raise with_path(error, path, replace=True) from error
            raise
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        _remove_quietly(tmp)
        if isinstance(error, OSError):
            raise with_path(error, path, replace=True) from error
        raise
    return path


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # a read-only file system refuses even that
        pass


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of UTF-8 text (``\\n`` line ends on every platform)."""
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


# ---- checksums of written files --------------------------------------------------------------------------------

CHECKSUM_NAME = "crc32"
"""The checksum recorded for checkpoint files: CRC-32 (zlib), which detects the accidental damage a checkpoint can
suffer (truncation, overwritten blocks, bit rot) and runs at memory speed; the sha256 of the shards would cost
about 1.5x more for no protection that matters here (tampering is the weights-only loader's business)."""


@dataclass(frozen=True)
class FileChecksum:
    bytes: int
    crc32: str
    """Eight hexadecimal digits."""

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, CHECKSUM_NAME: self.crc32}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FileChecksum:
        return cls(int(data["bytes"]), str(data[CHECKSUM_NAME]))


class ChecksumWriter:
    """A binary write-only file object that counts and CRC-32s the bytes passing through to ``handle``, so that a
    file's checksum costs no second read (``torch.save`` writes through it). The first OSError of a write is kept
    in ``error``: torch's writer swallows it and raises a RuntimeError that does not say what happened."""

    def __init__(self, handle: BinaryIO):
        self._handle = handle
        self._crc = 0
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data)
        self._crc = zlib.crc32(view, self._crc)  # releases the GIL on large buffers
        self.bytes += view.nbytes
        try:
            return self._handle.write(view)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self._handle.flush()

    @property
    def checksum(self) -> FileChecksum:
        return FileChecksum(self.bytes, f"{self._crc:08x}")


def file_checksum(path: str | os.PathLike, block_bytes: int = 1 << 22) -> FileChecksum:
    """Size and CRC-32 of a file, read in blocks into one reused buffer (memory does not grow with the file)."""
    crc, size = 0, 0
    buffer = bytearray(block_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            crc = zlib.crc32(view[:read], crc)
            size += read
    return FileChecksum(size, f"{crc:08x}")


def atomic_write_checksummed(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> FileChecksum:
    """`atomic_write` that returns the size and CRC-32 of the bytes written (computed as they pass)."""
    result: list[FileChecksum] = []

    def counted(handle: BinaryIO) -> None:
        writer = ChecksumWriter(handle)
        try:
            write(writer)
        except Exception as error:
            if writer.error is not None and writer.error is not error:
                raise writer.error from error  # no space, ...: what the caller's message should say
            raise
        result.append(writer.checksum)

    atomic_write(path, counted)
    return result[0]


# ---- write failures as one line --------------------------------------------------------------------------------

_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "not a directory (a file is in the way)",
    errno.EISDIR: "is a directory",
    errno.EEXIST: "already exists",
    errno.ENOENT: "no such file or directory",
    errno.EIO: "input/output error",
    errno.ENAMETOOLONG: "file name too long",
    errno.ESTALE: "stale file handle (the file was removed on the server)",
}


def with_path(error: OSError, path: str | os.PathLike, *, replace: bool = False) -> OSError:
    """``error`` naming ``path``: a write() that fails names no file, and a failure on a temporary should name
    the output it was for (``replace``). Unchanged when it names a file already (unless ``replace``) or has no
    errno."""
    if error.errno is None or (error.filename is not None and not replace):
        return error
    named = OSError(error.errno, error.strerror, str(path))  # OSError(...) picks the errno's subclass
    named.__cause__ = error
    return named


def describe_os_error(error: OSError, path: str | os.PathLike | None = None) -> str:
    """One line: the path and the cause in words ("runs/x/metrics.jsonl: read-only file system")."""
    where = path if path is not None else error.filename
    cause = _CAUSES.get(error.errno) or error.strerror or str(error)
    if error.filename2 is not None:
        where = f"{where} -> {error.filename2}"
    return f"{where}: {cause}" if where is not None else cause


def ensure_directory(path: str | os.PathLike) -> Path:
    """``mkdir -p``: a file in the way, a read-only parent, ... raise OSError naming the path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise with_path(error, path) from None
    return path


# ---- outputs that never destroy an input -----------------------------------------------------------------------

OUTPUT_MARKER = ".txl_dist-output"
"""Left in every folder a txl_dist conversion writes: ``overwrite`` replaces only an empty folder or one holding it."""


class OutputPathError(ValueError):
    """An output path that would destroy an input or files this tool did not write; the message names both."""


def refuse_output_over_inputs(output: str | os.PathLike, inputs: Sequence[str | os.PathLike]) -> None:
    """OutputPathError, before any work, for an output that is one of ``inputs``, contains one (a file or folder
    inside it) or lies inside one (symbolic links followed): writing or replacing it would destroy that input."""
    given = Path(output)
    out = given.resolve()
    for source in inputs:
        source_path = Path(source).resolve()
        if out == source_path:
            raise OutputPathError(f"output {given} is the input {source}: choose another output")
        if out in source_path.parents:
            raise OutputPathError(
                f"output {given} contains the input {source}: replacing it would delete the "
                f"input; choose another output"
            )
        if source_path in out.parents:
            raise OutputPathError(f"output {given} lies inside the input {source}: choose an output outside it")


def check_output_path(
    output: str | os.PathLike, inputs: Sequence[str | os.PathLike] = (), *, overwrite: bool, directory: bool = True
) -> Path:
    """Refuse, before any work, an output that would lose data; return it.

    Refused: an output that is one of ``inputs``, contains one, or lies inside one (symbolic links followed); an
    existing output without ``overwrite``; with ``overwrite``, a folder that is neither empty nor marked with
    `OUTPUT_MARKER` (so unrelated files are never deleted), or a file where a folder is expected and the reverse.
    """
    given = Path(output)
    refuse_output_over_inputs(given, inputs)
    if not (given.exists() or given.is_symlink()):
        return given
    if not overwrite:
        raise OutputPathError(f"{given}: already exists (pass --overwrite to replace it)")
    if not directory:
        if given.is_dir():
            raise OutputPathError(f"{given}: is a folder; the output is a file")
        return given
    if not given.is_dir():
        raise OutputPathError(f"{given}: is a file; --overwrite replaces only a folder this tool wrote")
    if any(given.iterdir()) and not (given / OUTPUT_MARKER).is_file():
        raise OutputPathError(
            f"{given}: holds files this tool did not write (no {OUTPUT_MARKER}); --overwrite "
            f"replaces only an empty folder or one written by txl_dist: remove it yourself or "
            f"choose another output"
        )
    return given


def mark_output(directory: str | os.PathLike, description: str) -> None:
    """Leave `OUTPUT_MARKER` in a folder being written (its staging copy), naming what wrote it."""
    Path(directory, OUTPUT_MARKER).write_text(json.dumps({"written_by": description}) + "\n", encoding="utf-8")


@contextmanager
def staged_output(out_dir: str | os.PathLike, written_by: str) -> Iterator[Path]:
    """A folder to write ``out_dir``'s files into: a staging folder beside it, marked as ours (``written_by``)
    and moved into place by `publish_directory` when the block ends, or removed on any error or interrupt, so
    that ``out_dir`` is either the old folder or the whole new one. An OSError on a path inside the staging
    folder is raised naming ``out_dir`` (the staging name means nothing to a user); others pass unchanged."""
    out_dir = Path(out_dir)
    try:
        ensure_directory(out_dir.parent)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    except OSError as error:
        raise with_path(error, out_dir, replace=True) from error
    try:
        yield staging
        mark_output(staging, written_by)
        publish_directory(staging, out_dir)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError) and str(error.filename or staging).startswith(str(staging)):
            raise with_path(error, out_dir, replace=True) from error  # ours, not an input's
        raise


def publish_directory(staging: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Move a finished staging folder to ``output`` (same parent), replacing an old one as late as possible: the
    old folder is moved aside before the new one takes its name, then deleted."""
    staging, output = Path(staging), Path(output)
    if not output.exists():
        os.replace(staging, output)
        return output
    aside = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=output.parent))
    os.replace(output, aside / output.name)
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(aside / output.name, output)
        aside.rmdir()
        raise
    shutil.rmtree(aside)
    return output
