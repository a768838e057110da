"""The character corpora as downloaded: ``enwik8`` / ``text8``, their ``.zip``, or a folder holding one of them.

A zip member is trusted only after its CRC-32 has been checked over all of its bytes. Python's `zipfile` checks
the CRC only when a member is read to its end, and the importers read byte ranges (enwik8's train range ends
10,000,000 bytes before the member's end), so a damaged archive would otherwise be read without a word. The check
costs one pass of decompression (about half a second for enwik8's 100 MB).

What a file is comes from its first bytes as well as its name: a zip archive saved as ``enwik8`` (or a raw file
saved as ``enwik8.zip``) is refused, and so is a folder holding both ``enwik8`` and ``enwik8.zip``, which would
leave the choice to the importer.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

from data_tools.errors import InputError

ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06", b"PK\x07\x08")  # a local file header; an empty archive; a spanned one
GZIP_MAGIC = b"\x1f\x8b"
_READ_BYTES = 1 << 20


def file_magic(path: str | os.PathLike) -> bytes:
    """The first four bytes of a file (fewer for a shorter file)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4)
    except OSError as error:
        raise InputError(f"{path}: cannot read ({error.strerror})") from error


def is_zip(magic: bytes) -> bool:
    return magic.startswith(ZIP_MAGICS)


def open_member(path: str, member: str) -> BinaryIO:
    """The decompressed bytes of ``member`` of the archive ``path`` (readable after the archive object closes)."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise InputError(f"{path}: not a readable zip archive ({error})") from error
    try:
        return archive.open(member)
    except KeyError:
        raise InputError(f"{path}: holds no file {member!r} (it holds {archive.namelist()[:5]})") from None
    finally:
        archive.close()


def check_member_crc(path: str | os.PathLike, member: str) -> None:
    """Read ``member`` of the archive ``path`` to its end, which makes `zipfile` compare its CRC-32 with the one
    the archive records; a damaged member (bad CRC, a broken deflate stream, a truncated archive) is an
    `InputError` naming the archive and the member."""
    try:
        with open_member(str(path), member) as handle:
            while handle.read(_READ_BYTES):
                pass
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as error:
        raise InputError(f"{path}: {member!r} inside is damaged ({error}); download the archive again") from error


def character_corpus(path: str | os.PathLike, name: str) -> tuple[str, str | None, int]:
    """(file, member inside a zip or None, bytes) of ``name`` (enwik8, text8) given as the file, its zip as
    downloaded, or a folder holding one of the two; a zip member's CRC is checked before it is returned."""
    path = Path(path)
    if path.is_dir():
        found = [c for c in (path / name, path / f"{name}.zip") if c.exists()]
        if not found:
            raise InputError(f"{path}: holds neither {name} nor {name}.zip")
        if len(found) == 2:
            raise InputError(
                f"{path}: holds both {name} and {name}.zip, which may differ; give the one to read as --input "
                f"({found[0]} or {found[1]})"
            )
        path = found[0]
    if not path.is_file():
        raise InputError(f"{path}: no such file (expected {name} or {name}.zip)")
    magic = file_magic(path)
    named_zip = path.suffix.lower() == ".zip"
    if is_zip(magic) and not named_zip:
        raise InputError(
            f"{path}: is a zip archive (it begins with 'PK'), not the raw {name}; name it {path.name}.zip, or unzip it"
        )
    if not named_zip:
        if magic.startswith(GZIP_MAGIC):
            raise InputError(f"{path}: is gzip-compressed, not the raw {name}; gunzip it first")
        return str(path.resolve()), None, path.stat().st_size
    if not is_zip(magic):
        raise InputError(
            f"{path}: named .zip but not a zip archive (it begins with {magic!r}); name it {name} if it is the raw file"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            members = [info for info in archive.infolist() if not info.is_dir()]
    except (zipfile.BadZipFile, OSError) as error:
        raise InputError(f"{path}: not a readable zip archive ({error})") from error
    info = next((i for i in members if Path(i.filename).name == name), members[0] if len(members) == 1 else None)
    if info is None:
        raise InputError(f"{path}: holds no file {name!r} (it holds {[i.filename for i in members][:5]})")
    check_member_crc(path, info.filename)
    return str(path.resolve()), info.filename, info.file_size
