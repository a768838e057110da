"""Block access to the shards of one split, and the per-epoch order of its blocks.

Two ways to reach a block, chosen per shard from its manifest path:

- a local file (a plain path, relative to the manifest's directory, or a ``file:`` URL) is read at random: the
  manifest's ``block_byte_offsets`` give the byte offset of the block's first tar header, and the two members of
  the block are parsed in place (``tarfile.TarInfo.frombuf``), so a block costs three small reads wherever it
  lies;
- any other URL (``pipe:aws s3 cp ... -``, ``http://...``) is read sequentially through webdataset
  (``gopen`` and its tar iterator). A `BlockCursor` keeps its shard open and moves forward through it, so a
  stream that reads its blocks in order reads each byte once, after a first scan from the start of the shard to
  where the stream begins (at most one shard per stream per epoch, and per resume). Every stream has its own
  cursor, so a rank holds micro_batch x grad_accum open streams (subprocesses, for ``pipe:``). A block behind the
  cursor, or in another shard, reopens that shard and scans from its start: correct but slow, which is what the
  per-epoch block shuffle does to remote shards. Copy shards to a local or shared file system for shuffled
  training.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import webdataset as wds

from txl_dist.data.format import TOKENS_EXT, Manifest, ManifestError, block_key, decode_array, decode_block

logger = logging.getLogger("txl_dist.data")

_TAR_BLOCK = 512
_HASH_CHUNK = 1 << 20


class ShardError(ManifestError):
    """A shard that is missing, truncated, altered or not what its manifest says; the message names the file."""


def local_path(location: str) -> str | None:
    """The file system path of a shard location, or None when it is a URL that only webdataset can open."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return url2pathname(parsed.path)
    # A one-letter "scheme" is a Windows drive, not a URL.
    if parsed.scheme == "" or len(parsed.scheme) == 1:
        return location
    return None


class ShardStore:
    """The shards of one split: where each lives, which blocks it holds, and their checks.

    Every local shard must exist and have the size its manifest gives when the store is made; with
    ``verify_sha256`` each shard (local or remote) is hashed once, before its first block is read.
    """

    def __init__(self, directory: str | os.PathLike, manifest: Manifest, split: str, *, verify_sha256: bool = False):
        self.split = split
        self.manifest_path = str(Path(directory) / "manifest.json")
        self.dtype = np.dtype(manifest.dtype)
        self.shards = manifest.splits[split].shards
        self.verify_sha256 = verify_sha256
        self.locations = [
            shard.path if local_path(shard.path) is None else str(Path(directory) / local_path(shard.path))
            for shard in self.shards
        ]
        self.block_tokens = np.array([n for shard in self.shards for n in shard.block_tokens], dtype=np.int64)
        self._first_blocks = np.array([shard.block_offset for shard in self.shards], dtype=np.int64)
        self._checked = [False] * len(self.shards)
        for shard_index in range(len(self.shards)):
            if self.is_local(shard_index):
                self._check_file(shard_index)

    def shard_of(self, block: int) -> int:
        return int(np.searchsorted(self._first_blocks, block, side="right")) - 1

    def is_local(self, shard_index: int) -> bool:
        return local_path(self.locations[shard_index]) is not None

    def _check_file(self, shard_index: int) -> None:
        """A local shard must exist with the size its manifest gives (a stat: cheap enough to do for all at once)."""
        path = local_path(self.locations[shard_index])
        expected = self.shards[shard_index].bytes
        if not os.path.isfile(path):
            raise ShardError(f"{path}: shard missing (listed in {self.manifest_path}, split '{self.split}')")
        size = os.path.getsize(path)
        if size != expected:
            raise ShardError(
                f"{path}: shard is {size} bytes, {self.manifest_path} says {expected} "
                f"({'truncated' if size < expected else 'altered'})"
            )

    def check(self, shard_index: int) -> None:
        """The sha256 of a shard, when asked for, once, before its first block is read."""
        if self._checked[shard_index]:
            return
        if self.verify_sha256:
            expected, found = self.shards[shard_index].sha256, self._sha256(shard_index)
            if found != expected:
                raise ShardError(
                    f"{self.locations[shard_index]}: sha256 mismatch: {self.manifest_path} expects {expected}, "
                    f"the file has {found}"
                )
        self._checked[shard_index] = True

    def _sha256(self, shard_index: int) -> str:
        location = self.locations[shard_index]
        digest = hashlib.sha256()
        try:
            with wds.gopen(location, "rb") as stream:
                while chunk := stream.read(_HASH_CHUNK):
                    digest.update(chunk)
        except OSError as error:
            raise ShardError(f"{location}: cannot read shard to verify its sha256 ({error})") from error
        return digest.hexdigest()

    def read_local(self, block: int) -> np.ndarray:
        """The tokens of ``block`` from a local shard, read in place at its manifest byte offset."""
        shard_index = self.shard_of(block)
        self.check(shard_index)
        shard, path = self.shards[shard_index], local_path(self.locations[shard_index])
        key = block_key(block)
        position = shard.block_byte_offsets[block - shard.block_offset]
        with open(path, "rb") as handle:
            fd = handle.fileno()
            # A block is two members, doc_offsets.npy then tokens.npy (the tar writer sorts them); skip to tokens.
            for _ in range(2):
                header = os.pread(fd, _TAR_BLOCK, position)
                if len(header) < _TAR_BLOCK:
                    raise ShardError(
                        f"{path}: truncated: block {key} needs a tar header at byte {position}, the file ends first"
                    )
                try:
                    member = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
                except tarfile.HeaderError as error:
                    raise ShardError(f"{path}: bad tar header at byte {position} for block {key} ({error})") from error
                name_key, _, ext = member.name.partition(".")
                if name_key != key or not member.isreg():
                    raise ShardError(
                        f"{path}: at byte {position} {self.manifest_path} places block {key}, the file has "
                        f"member '{member.name}': the manifest does not describe this file"
                    )
                data_position = position + _TAR_BLOCK
                if ext == TOKENS_EXT:
                    data = os.pread(fd, member.size, data_position)
                    if len(data) < member.size:
                        raise ShardError(f"{path}: truncated inside block {key} (member '{member.name}')")
                    return self._checked_tokens(decode_array(data, f"{path} block {key} {TOKENS_EXT}"), block, path)
                position = data_position + -(-member.size // _TAR_BLOCK) * _TAR_BLOCK
        raise ShardError(f"{path}: block {key} has no member '{TOKENS_EXT}'")

    def _checked_tokens(self, tokens: np.ndarray, block: int, where: str) -> np.ndarray:
        if tokens.dtype != self.dtype or tokens.ndim != 1 or tokens.size != self.block_tokens[block]:
            raise ShardError(
                f"{where}: block {block_key(block)} holds {tokens.size} {tokens.dtype} tokens, "
                f"{self.manifest_path} says {self.block_tokens[block]} {self.dtype}"
            )
        return tokens

    def open_cursor(self) -> BlockCursor:
        return BlockCursor(self)


class BlockCursor:
    """Reads blocks for one consumer: in place from local shards, forward through an open stream from URLs."""

    def __init__(self, store: ShardStore):
        self._store = store
        self._shard_index = -1
        self._samples: Iterator[dict] | None = None
        self._stream = None
        self._next_block = -1

    def read(self, block: int) -> np.ndarray:
        store = self._store
        shard_index = store.shard_of(block)
        if store.is_local(shard_index):
            return store.read_local(block)
        if shard_index != self._shard_index or block < self._next_block:
            self._open(shard_index)
        location = store.locations[shard_index]
        key = block_key(block)
        try:
            for sample in self._samples:
                self._next_block = int(sample["__key__"]) + 1
                if sample["__key__"] == key:
                    tokens, _ = decode_block(sample, location)
                    return store._checked_tokens(tokens, block, location)
        except (OSError, tarfile.TarError, ValueError) as error:
            self.close()
            # webdataset appends its stream objects to the arguments; the first one is the message.
            detail = error.args[0] if error.args and isinstance(error.args[0], str) else repr(error)
            raise ShardError(f"{location}: cannot read block {key}: {detail}") from error
        self.close()
        raise ShardError(
            f"{location}: the shard ends before block {key} (truncated, or not the file its manifest lists)"
        )

    def _open(self, shard_index: int) -> None:
        self.close()
        self._store.check(shard_index)
        location = self._store.locations[shard_index]
        try:
            self._stream = wds.gopen(location, "rb")
        except OSError as error:
            raise ShardError(f"{location}: cannot open shard ({error})") from error
        files = wds.tariterators.tar_file_expander([{"url": location, "stream": self._stream}])
        self._samples = wds.tariterators.group_by_keys(files)
        self._shard_index = shard_index
        self._next_block = self._store.shards[shard_index].block_offset

    def close(self) -> None:
        """Release an open remote stream (and its subprocess, for ``pipe:``)."""
        stream, self._stream, self._samples, self._shard_index = self._stream, None, None, -1
        if stream is not None:
            try:
                stream.close()
            except OSError:
                # A pipe closed before its end reports the reader's early exit; nothing is lost.
                pass


class BlockOrder:
    """One epoch's order of a split's blocks, and the map from a position in that order to block pieces."""

    def __init__(self, block_tokens: np.ndarray, permutation: np.ndarray | None = None):
        self.blocks = np.arange(block_tokens.size) if permutation is None else permutation
        self.starts = np.zeros(block_tokens.size + 1, dtype=np.int64)
        np.cumsum(block_tokens[self.blocks], out=self.starts[1:])
        self.total = int(self.starts[-1])

    @classmethod
    def for_epoch(cls, block_tokens: np.ndarray, *, shuffle: bool, seed: int, epoch: int) -> BlockOrder:
        """Manifest order, or a permutation seeded by (seed, epoch): every epoch its own, every resume the same."""
        if not shuffle:
            return cls(block_tokens)
        generator = np.random.Generator(np.random.PCG64([seed, epoch]))
        return cls(block_tokens, generator.permutation(block_tokens.size))

    def pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(block, first, end) for the tokens at positions [start, stop) of this order, in order."""
        index = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            block_start = int(self.starts[index])
            end = min(stop, int(self.starts[index + 1]))
            if end > start:
                yield int(self.blocks[index]), start - block_start, end - block_start
            start = max(start, end)
            index += 1


class StreamReader:
    """Copies token ranges of one stream, keeping only the block it read last (the next read usually starts in it)."""

    def __init__(self, store: ShardStore):
        self._cursor = store.open_cursor()
        self._block = -1
        self._tokens: np.ndarray | None = None

    def copy(self, order: BlockOrder, start: int, stop: int, out: np.ndarray) -> None:
        """Write the tokens at positions [start, stop) of ``order`` into ``out`` (of length stop - start)."""
        filled = 0
        for block, first, end in order.pieces(start, stop):
            if block != self._block:
                self._tokens = None  # drop the old block before reading the next: one block per stream
                self._tokens = self._cursor.read(block)
                self._block = block
            out[filled : filled + end - first] = self._tokens[first:end]
            filled += end - first

    def close(self) -> None:
        self._cursor.close()
