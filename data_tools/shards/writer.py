"""Write the blocks of one split into webdataset tars of the format in `txl_dist.data.format`.

The writer knows nothing about text: it takes blocks of token ids (with the positions where documents begin)
and cuts them into shards of about ``tokens_per_shard`` tokens. A shard is written under a temporary name and
renamed when complete, so a directory never holds a half-written ``.tar`` under a final name.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import webdataset as wds

from txl_dist.data.format import DOC_OFFSETS_EXT, TAR_MTIME, TOKENS_EXT, ShardEntry, block_key, encode_block, shard_name
from txl_dist.fileio import AtomicFile


@dataclasses.dataclass
class _OpenShard:
    """The shard being written: its file (under a temporary name until it is finished) and what it holds so far."""

    name: str
    file: AtomicFile
    token_offset: int
    block_offset: int
    tar: wds.TarWriter | None = None
    keys: list[str] = dataclasses.field(default_factory=list)
    block_tokens: list[int] = dataclasses.field(default_factory=list)
    documents: int = 0
    words: int = 0
    characters: int = 0


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
        self._open: _OpenShard | None = None

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
        shard.tar.write(encode_block(self._block_offset, tokens.astype(self.dtype), doc_offsets))
        shard.keys.append(block_key(self._block_offset))
        shard.block_tokens.append(int(tokens.size))
        shard.documents += int(doc_offsets.size)
        shard.words += int(words)
        shard.characters += int(characters)
        self._block_offset += 1
        self._token_offset += int(tokens.size)
        if sum(shard.block_tokens) >= self.tokens_per_shard:
            self._finish_shard()

    def _start_shard(self) -> None:
        name = shard_name(self.split, self._next_index)
        shard = _OpenShard(name, AtomicFile(self.directory / name, "sha256"), self._token_offset, self._block_offset)
        # Recorded before its file exists: an interruption from here on (Ctrl-C) finds the file to remove.
        self._open = shard
        shard.file.open()
        shard.tar = wds.TarWriter(shard.file, encoder=False, mtime=TAR_MTIME, user="txl", group="txl", mode=0o444)

    def _finish_shard(self) -> None:
        # self._open stays set until the rename, so that an interruption before it removes the partial file.
        shard = self._open
        shard.tar.close()
        shard.file.close()
        offsets = member_offsets(shard.file.temporary)
        shard.file.commit()
        self._open = None
        entry = ShardEntry(
            path=shard.name,
            sha256=shard.file.hexdigest(),
            bytes=shard.file.bytes,
            blocks=len(shard.keys),
            documents=shard.documents,
            tokens=sum(shard.block_tokens),
            token_offset=shard.token_offset,
            block_offset=shard.block_offset,
            block_tokens=shard.block_tokens,
            block_byte_offsets=[
                min(offsets[f"{key}.{ext}"] for ext in (TOKENS_EXT, DOC_OFFSETS_EXT)) for key in shard.keys
            ],
            words=shard.words,
            characters=shard.characters,
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
        # Leave no partial shard behind on failure; finished shards stay for --resume.
        shard, self._open = self._open, None
        if shard is not None:
            if shard.tar is not None:
                try:
                    shard.tar.close()
                except OSError:  # the same full or failing disk as the error being raised: that one says it
                    pass
            shard.file.discard()
