"""The inputs a command reads, each an `InputFile`: a plain text file, a gzip-compressed one (``.gz``), JSON Lines
(``.jsonl``, ``.jsonl.gz``: one JSON object per line, the document's text in one of its fields), a byte range of a
file or of the file inside a ``.zip`` (the character benchmarks of `data_tools.corpora.published`), or the Penn
Treebank of the ``treebank`` package (``treebank:penn/{split}``). `input_files` turns paths and glob patterns into
inputs, refusing what cannot be read as text; `InputFile.open` gives the bytes of any input, a byte range in the
offsets of its whole file (`_ByteRange`)."""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from data_tools.corpora import zip_member
from data_tools.errors import InputError

TREEBANK_PREFIX = "treebank:penn/"


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input: a path, or ``treebank:penn/{split}`` for the Penn Treebank of the ``treebank`` package."""

    name: str
    size: int
    """Bytes on disk (compressed bytes for ``.gz``); for a byte range, the range's length."""
    start: int = 0
    """First byte of the range read (enwik8/text8 splits); offsets of chunks stay offsets in the whole file."""
    stop: int | None = None
    """End of the range read (exclusive); None: the end of the file."""
    member: str | None = None
    """The file inside a ``.zip`` archive (enwik8.zip holds ``enwik8``); offsets count its decompressed bytes."""

    @property
    def jsonl(self) -> bool:
        return self.name.endswith((".jsonl", ".jsonl.gz"))

    @property
    def compressed(self) -> bool:
        """Chunks of this input travel to workers with their bytes (they cannot be re-read by offset cheaply)."""
        return self.name.endswith(".gz") or self.member is not None

    def open(self) -> BinaryIO:
        if self.name.startswith(TREEBANK_PREFIX):
            return io.BytesIO(treebank_text(self.name.removeprefix(TREEBANK_PREFIX)))
        try:
            if self.member is not None:
                handle = zip_member.open_member(self.name, self.member)
            else:
                handle = gzip.open(self.name, "rb") if self.name.endswith(".gz") else open(self.name, "rb")
        except OSError as error:
            raise InputError(f"{self.name}: cannot open input ({error.strerror})") from error
        if self.start or self.stop is not None:
            return _ByteRange(handle, self.start, self.stop)
        return handle

    def describe(self) -> dict[str, object]:
        """What identifies this input in a build record (``--resume`` checks it, and the sha256 of the bytes read:
        `data_tools.shards.input_digests`)."""
        described: dict[str, object] = {"name": self.name, "size": self.size}
        if self.start or self.stop is not None:
            described.update(start=self.start, stop=self.stop)
        if self.member is not None:
            described["member"] = self.member
        return described


class _ByteRange(io.RawIOBase):
    """Bytes [start, stop) of a file, read, read line by line and sought in the file's own offsets."""

    def __init__(self, handle: BinaryIO, start: int, stop: int | None):
        super().__init__()
        self._handle, self._start, self._stop = handle, start, stop
        handle.seek(start)
        self._position = start

    def _room(self, size: int) -> int:
        left = None if self._stop is None else max(0, self._stop - self._position)
        if size is None or size < 0:
            return -1 if left is None else left
        return size if left is None else min(size, left)

    def read(self, size: int = -1) -> bytes:
        room = self._room(size)
        data = self._handle.read(room) if room != 0 else b""
        self._position += len(data)
        return data

    def readline(self, size: int = -1) -> bytes:
        room = self._room(size)
        data = self._handle.readline(room) if room != 0 else b""
        self._position += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a byte range seeks to absolute offsets only")
        self._position = self._handle.seek(max(offset, self._start))
        return self._position

    def tell(self) -> int:
        return self._position

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._handle.close()
        super().close()


def treebank_text(split: str) -> bytes:
    """The text of the Penn Treebank split ``split`` of the ``treebank`` package, as UTF-8 bytes."""
    import treebank  # optional dependency: a test and demo extra (pyproject.toml), not needed by the package

    return treebank.penn[split].encode("utf-8")


def input_files(patterns: Sequence[str]) -> list[InputFile]:
    """The files named by paths and glob patterns, each pattern's matches sorted (absolute paths)."""
    files: list[InputFile] = []
    for pattern in patterns:
        if any(char in pattern for char in "*?["):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise InputError(f"{pattern}: no input file matches this pattern")
        else:
            matches = [pattern]
        for match in matches:
            path = Path(match)
            if not path.exists():
                raise InputError(f"{match}: no such input file")
            if path.is_dir():
                raise InputError(f"{match}: is a directory; give files, or a pattern such as '{match}/*.txt'")
            if zip_member.is_zip(zip_member.file_magic(path)):
                raise InputError(
                    f"{match}: is a zip archive, which is not read as text; unzip it (enwik8.zip and text8.zip: "
                    f"--format enwik8|text8 --input {match})"
                )
            files.append(InputFile(os.path.abspath(match), path.stat().st_size))
    names = [f.name for f in files]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InputError(f"{repeated[0]}: given more than once (its documents would be read twice)")
    return files
