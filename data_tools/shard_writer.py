"""Write the blocks of one split into webdataset tars of the format in `txl_dist.data.format`.

The writer knows nothing about text: it takes blocks of token ids (with the positions where documents begin)
and cuts them into shards of about ``tokens_per_shard`` tokens. A shard is written under a temporary name and
renamed when complete, so a directory never holds a half-written ``.tar`` under a final name.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import webdataset as wds

from txl_dist.data.format import DOC_OFFSETS_EXT, TAR_MTIME, TOKENS_EXT, ShardEntry, block_key, encode_block, shard_name
from txl_dist.fileio import with_path


class _HashingFile:
    """A write-only file that hashes and counts what passes through it. A failing write (no space left, ...)
    raises OSError naming ``name`` (the shard being written; write() itself names no file)."""

    def __init__(self, path: Path, name: Path):
        self.path = name
        try:
            self._handle = open(path, "wb")
        except OSError as error:
            raise with_path(error, name, replace=True) from error
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self._handle.write(data)
        except OSError as error:
            raise with_path(error, self.path, replace=True) from error

    def flush(self) -> None:
        try:
            self._handle.flush()
        except OSError as error:
            raise with_path(error, self.path, replace=True) from error

    def close(self) -> None:
        if self._handle.closed:
            return
        try:
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as error:
            raise with_path(error, self.path, replace=True) from error
        finally:
            try:
                self._handle.close()
            except OSError:  # the buffer it could not write; the error above says why
                pass


def member_offsets(path: str | os.PathLike) -> dict[str, int]:
    """Byte offset of each member's header in a tar, by member name (reads headers only)."""
    with tarfile.open(path, "r:") as archive:
        return {member.name: member.offset for member in archive}


class ShardWriter:
    """Blocks in, shards out. Use as a context manager, or call `close()` to finish the last shard.

    ``on_shard`` is called with each finished `ShardEntry` (after its file has its final name), which lets a
    builder journal its progress for ``--resume``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        split: str,
        vocab_size: int,
        dtype: np.dtype,
        tokens_per_shard: int,
        *,
        first_shard_index: int = 0,
        first_token_offset: int = 0,
        first_block_offset: int = 0,
        on_shard: Callable[[ShardEntry], None] | None = None,
    ):
        if tokens_per_shard <= 0:
            raise ValueError(f"tokens_per_shard must be positive, got {tokens_per_shard}")
        self.directory = Path(directory)
        self.split = split
        self.vocab_size = vocab_size
        self.dtype = np.dtype(dtype)
        self.tokens_per_shard = tokens_per_shard
        self.on_shard = on_shard
        self.shards: list[ShardEntry] = []
        self._next_index = first_shard_index
        self._token_offset = first_token_offset
        self._block_offset = first_block_offset
        self._open: dict | None = None

    def add_block(self, tokens: np.ndarray, doc_offsets: np.ndarray, words: int = 0, characters: int = 0) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"split {self.split}: a block needs a non-empty 1-D token array")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise ValueError(
                f"split {self.split}, block {self._block_offset}: token ids must lie in [0, {self.vocab_size}), "
                f"got [{tokens.min()}, {tokens.max()}]"
            )
        doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
        if doc_offsets.size and (
            doc_offsets.min() < 0 or doc_offsets.max() >= tokens.size or np.any(np.diff(doc_offsets) <= 0)
        ):
            raise ValueError(
                f"split {self.split}, block {self._block_offset}: doc_offsets must increase within the block"
            )
        if self._open is None:
            self._start_shard()
        shard = self._open
        shard["writer"].write(encode_block(self._block_offset, tokens.astype(self.dtype), doc_offsets))
        shard["keys"].append(block_key(self._block_offset))
        shard["block_tokens"].append(int(tokens.size))
        shard["documents"] += int(doc_offsets.size)
        shard["words"] += int(words)
        shard["characters"] += int(characters)
        self._block_offset += 1
        self._token_offset += int(tokens.size)
        if sum(shard["block_tokens"]) >= self.tokens_per_shard:
            self._finish_shard()

    def _start_shard(self) -> None:
        name = shard_name(self.split, self._next_index)
        tmp = self._partial_path(self._next_index)
        handle = _HashingFile(tmp, self.directory / name)
        writer = wds.TarWriter(handle, encoder=False, mtime=TAR_MTIME, user="txl", group="txl", mode=0o444)
        self._open = {
            "name": name,
            "tmp": tmp,
            "handle": handle,
            "writer": writer,
            "keys": [],
            "block_tokens": [],
            "documents": 0,
            "words": 0,
            "characters": 0,
            "token_offset": self._token_offset,
            "block_offset": self._block_offset,
        }

    def _finish_shard(self) -> None:
        # self._open stays set until the rename, so that an interruption before it removes the partial file.
        shard = self._open
        shard["writer"].close()
        shard["handle"].close()
        offsets = member_offsets(shard["tmp"])
        os.replace(shard["tmp"], self.directory / shard["name"])
        self._open = None
        entry = ShardEntry(
            path=shard["name"],
            sha256=shard["handle"].sha256.hexdigest(),
            bytes=shard["handle"].size,
            blocks=len(shard["keys"]),
            documents=shard["documents"],
            tokens=sum(shard["block_tokens"]),
            token_offset=shard["token_offset"],
            block_offset=shard["block_offset"],
            block_tokens=shard["block_tokens"],
            block_byte_offsets=[
                min(offsets[f"{key}.{ext}"] for ext in (TOKENS_EXT, DOC_OFFSETS_EXT)) for key in shard["keys"]
            ],
            words=shard["words"],
            characters=shard["characters"],
        )
        self.shards.append(entry)
        self._next_index += 1
        if self.on_shard is not None:
            self.on_shard(entry)

    def close(self) -> list[ShardEntry]:
        if self._open is not None:
            self._finish_shard()
        return self.shards

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Leave no partial shard behind on failure; finished shards stay for --resume. The partial file is found
        # by name, not through self._open: an interruption (Ctrl-C) can come after `_start_shard` created the
        # file and before it recorded it.
        shard, self._open = self._open, None
        self._partial_path(self._next_index).unlink(missing_ok=True)
        if shard is not None:
            try:
                shard["writer"].close()
                shard["handle"].close()
            except OSError:  # the same full or failing disk as the error being raised: that one says it
                pass

    def _partial_path(self, index: int) -> Path:
        return self.directory / f".{shard_name(self.split, index)}.partial"
