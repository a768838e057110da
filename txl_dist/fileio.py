"""Small file helpers shared by the tokenizer, the shard builder, checkpoints and conversions: checksums, atomic
writes, JSON files read with one-line errors, write failures in one line, new folders and files with the modes a
user's umask gives. Outputs that never destroy an input: `txl_dist.output_folders`."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
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


class AtomicFile:
    """A binary write-only file that a reader never sees a part of: the bytes go to a temporary file beside
    ``path``, which `commit` syncs and renames to ``path`` and `discard` removes.

    The bytes are counted and, with ``checksum`` ("crc32" or a `hashlib` name such as "sha256"), hashed as they
    pass, so a file's checksum costs no second read. A failing write raises OSError naming ``path`` (write() itself
    names no file, and the temporary name means nothing to a user); the first one is kept in ``error``, since a
    writer that calls `write` may swallow it (torch's raises a RuntimeError that does not say what happened).
    """

    def __init__(self, path: str | os.PathLike, checksum: str | None = None):
        self.path = Path(path)
        self.temporary: Path | None = None
        """The temporary file, once `open` created it (None again after `commit` or `discard`)."""
        self.bytes = 0
        self.error: OSError | None = None
        self._handle: BinaryIO | None = None
        self._crc = 0 if checksum == "crc32" else None
        self._hash = hashlib.new(checksum) if checksum not in (None, "crc32") else None

    def open(self) -> AtomicFile:
        """Create the temporary file (mode 0666 less the umask, as open() gives: the other accounts of a shared
        cluster can read the result)."""
        while True:
            tmp = self.path.parent / f".{self.path.name}.{secrets.token_hex(8)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
                self.temporary = tmp
                break
            except FileExistsError:  # somebody else's file of that name: not ours to remove
                continue
            except BaseException as error:
                # Removed by name: an interrupt can arrive after the file was created and before `fd` was set.
                _remove_quietly(tmp)
                if isinstance(error, OSError):
                    raise with_path(error, self.path, replace=True) from error
                raise
        self._handle = os.fdopen(fd, "wb")
        return self

    def write(self, data) -> int:
        view = memoryview(data)
        if self._crc is not None:
            self._crc = zlib.crc32(view, self._crc)  # releases the GIL on large buffers
        elif self._hash is not None:
            self._hash.update(view)
        self.bytes += view.nbytes
        with self._naming_errors():
            return self._handle.write(view)

    def flush(self) -> None:
        with self._naming_errors():
            self._handle.flush()

    def hexdigest(self) -> str:
        """The checksum of the bytes written so far (eight hexadecimal digits for CRC-32)."""
        return f"{self._crc:08x}" if self._crc is not None else self._hash.hexdigest()

    def close(self) -> None:
        """Sync and close the temporary file (it keeps its name until `commit`)."""
        if self._handle is None or self._handle.closed:
            return
        try:
            with self._naming_errors():
                self._handle.flush()
                os.fsync(self._handle.fileno())
        finally:
            try:
                self._handle.close()
            except OSError:  # the buffer it could not write; the error above says why
                pass

    def commit(self) -> Path:
        """Close the file and give it its name ``path``."""
        self.close()
        with self._naming_errors():
            os.replace(self.temporary, self.path)
        self.temporary = None
        return self.path

    def discard(self) -> None:
        """Remove the temporary file, quietly: the error that led here is the one to report."""
        try:
            self.close()
        except OSError:
            pass
        if self.temporary is not None:
            _remove_quietly(self.temporary)
            self.temporary = None

    @contextmanager
    def _naming_errors(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            named = with_path(error, self.path, replace=True)
            self.error = self.error or named
            if named is error:  # no errno: nothing to name
                raise
            raise named from error


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Create ``path`` through ``write(binary file)`` so that a reader sees the old file or the whole new one,
    never a part (an `AtomicFile`). On any failure, Ctrl-C included, the temporary file is removed and ``path``
    is left as it was; an OSError (no space, read-only, ...) names ``path``."""
    return _write_atomically(path, write, None).path


def _write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], object], checksum: str | None) -> AtomicFile:
    file = AtomicFile(path, checksum)
    try:
        file.open()
        write(file)
        file.commit()
    except BaseException as error:
        file.discard()
        if isinstance(error, Exception) and file.error is not None and file.error is not error:
            raise file.error from error  # no space, ...: what the caller's message should say
        if isinstance(error, OSError):
            raise with_path(error, path, replace=True) from error
        raise
    return file


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # a read-only file system refuses even that
        pass


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of UTF-8 text (``\\n`` line ends on every platform)."""
    return atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def read_json(
    path: str | os.PathLike,
    error: Callable[[str], Exception] = ValueError,
    problem: str = "not valid JSON",
    advice: str = "",
    *,
    expect_object: bool = False,
) -> Any:
    """The JSON value in ``path``: the one reader of this project's JSON files. A file that cannot be read, or is
    not UTF-8 JSON, raises ``error`` with one line that names it: "PATH: PROBLEM (the cause)ADVICE"; with
    ``expect_object``, so does a value other than an object ("PATH: expected a JSON object")."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as cause:
        raise error(f"{path}: {problem} ({cause}){advice}") from cause
    if expect_object and not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object")
    return value


# ---- checksums of written files --------------------------------------------------------------------------------

CHECKSUM_NAME = "crc32"
"""The checksum recorded for checkpoint files: CRC-32 (zlib), which detects the accidental damage a checkpoint can
suffer (truncation, overwritten blocks, bit rot) and runs at memory speed; the sha256 of the shards costs more
(benchmarks/checkpoint_checksum.py prints both) for no protection that matters here (tampering is the weights-only
loader's business)."""


@dataclass(frozen=True)
class FileChecksum:
    bytes: int
    crc32: str
    """Eight hexadecimal digits."""

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, CHECKSUM_NAME: self.crc32}

    @classmethod
    def from_json(cls, data: Any) -> FileChecksum:
        """The checksum a JSON record holds (``{"bytes": N, "crc32": "8 hexadecimal digits"}``); ValueError saying
        what is wrong with any other value (a size given as a string or a float is not read as a number)."""
        if not isinstance(data, dict):
            raise ValueError(f'{data!r} is not {{"bytes": N, "{CHECKSUM_NAME}": "8 hexadecimal digits"}}')
        size, crc = data.get("bytes"), data.get(CHECKSUM_NAME)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f'"bytes" is {size!r}, not a size (a whole number of bytes)')
        if not isinstance(crc, str) or not re.fullmatch(r"[0-9a-fA-F]{8}", crc):
            raise ValueError(f'"{CHECKSUM_NAME}" is {crc!r}, not eight hexadecimal digits')
        return cls(size, crc.lower())


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
    file = _write_atomically(path, write, CHECKSUM_NAME)
    return FileChecksum(file.bytes, file.hexdigest())


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
    target = dangling_link(where) if where is not None and error.errno == errno.EEXIST else None
    if target is not None:  # mkdir's "File exists" for a link whose target is missing
        cause = f"a symbolic link to {target}, which leads nowhere: create its target or remove the link"
    if error.filename2 is not None:
        where = f"{where} -> {error.filename2}"
    return f"{where}: {cause}" if where is not None else cause


def dangling_link(path: str | os.PathLike) -> str | None:
    """What a symbolic link ``path`` points to when that leads nowhere (a missing target, a loop of links); None
    for anything else."""
    return os.readlink(path) if os.path.islink(path) and not os.path.exists(path) else None


def ensure_directory(path: str | os.PathLike) -> Path:
    """``mkdir -p``: a file in the way, a read-only parent, a dangling symbolic link ... raise OSError naming the
    path."""
    path = Path(path)
    for folder in (path, *path.parents):
        if dangling_link(folder) is not None:
            raise FileExistsError(errno.EEXIST, "File exists", str(folder))  # as mkdir says it
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise with_path(error, path) from None
    return path


# ---- new folders and files -------------------------------------------------------------------------------


def make_temporary_directory(
    parent: str | os.PathLike, prefix: str, suffix: str = ".tmp", made: list[Path] | None = None
) -> Path:
    """A new, uniquely named folder in ``parent``, made as ``mkdir`` makes one: mode 0777 less the umask (what
    ``tempfile.mkdtemp`` gives is 0700, which a staging folder would keep once renamed into place, and the other
    accounts of a shared cluster could not read the result). ``made``: a list that holds the folder's name from
    just before it is made, so that a caller interrupted (Ctrl-C) between the ``mkdir`` and this function's return
    can still remove it."""
    while True:
        path = Path(parent, f"{prefix}{secrets.token_hex(8)}{suffix}")
        if made is not None:
            made.append(path)
        try:
            path.mkdir(0o777)
            return path
        except FileExistsError:  # somebody else's folder of that name
            if made is not None:
                made.remove(path)
            continue


def chmod_as_new_file(path: str | os.PathLike) -> None:
    """Give ``path`` the mode that ``open()`` would give a new file beside it (0666 less the umask), for files
    that a library writes with modes of its own (safetensors' 0600). The mode is read from a file made there, as
    the umask cannot be read without changing it (a race with every other thread)."""
    path = Path(path)
    probe = path.parent / f".{path.name}.{secrets.token_hex(8)}.mode"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = os.fstat(fd).st_mode
    finally:
        os.close(fd)
        _remove_quietly(probe)
    os.chmod(path, mode & 0o777)
