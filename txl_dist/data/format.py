"""The shard format: what `data_tools.build_shards` writes and `txl_dist.data` reads.

A split is a sequence of webdataset tars ``{split}-{index:06d}.tar``. Each sample of a tar is one *block*: the
tokens of whole consecutive documents (a document longer than a block continues in the next block), stored as

- ``{key}.tokens.npy``: 1-D ``uint16`` (vocabularies up to 65,536 entries) or ``uint32`` array, the documents in
  order, each followed by the manifest's ``eod_id``, so that concatenating the blocks of a split in order gives
  exactly the split's token stream;
- ``{key}.doc_offsets.npy``: 1-D ``int64`` array, the positions in ``tokens`` where a document begins (empty for
  a block that lies wholly inside one long document).

``key`` is the block's global index within its split, zero-padded to 12 digits. ``manifest.json`` describes
the whole build and is written last, atomically: a directory without one is an unfinished build.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from txl_dist.fileio import atomic_write_text, dangling_link, read_json

FORMAT_NAME = "txl_dist.shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENS_EXT = "tokens.npy"
DOC_OFFSETS_EXT = "doc_offsets.npy"
# Fixed tar member mtime so that the same input gives byte-identical shards (an int: a float mtime makes the
# tar writer add a pax header to every member).
TAR_MTIME = 0


class ManifestError(ValueError):
    """A manifest or shard that does not match the format; the message names the file and the key."""


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def block_key(global_block_index: int) -> str:
    return f"{global_block_index:012d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary of ``vocab_size`` entries."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def encode_array(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def decode_array(data: bytes, where: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as error:  # numpy raises several types for a damaged header
        raise ManifestError(f"{where}: not a valid .npy array ({error})") from error


def encode_block(global_block_index: int, tokens: np.ndarray, doc_offsets: np.ndarray) -> dict[str, Any]:
    """One block as a webdataset sample (already-encoded bytes, for ``TarWriter(encoder=False)``)."""
    return {
        "__key__": block_key(global_block_index),
        TOKENS_EXT: encode_array(tokens),
        DOC_OFFSETS_EXT: encode_array(np.asarray(doc_offsets, dtype=np.int64)),
    }


def decode_block(sample: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, doc_offsets) of a raw webdataset sample; ``where`` names the shard in errors."""
    key = sample.get("__key__", "?")
    for ext in (TOKENS_EXT, DOC_OFFSETS_EXT):
        if ext not in sample:
            raise ManifestError(f"{where}: block {key} has no member '{ext}'")
    tokens = decode_array(sample[TOKENS_EXT], f"{where} block {key} {TOKENS_EXT}")
    doc_offsets = decode_array(sample[DOC_OFFSETS_EXT], f"{where} block {key} {DOC_OFFSETS_EXT}")
    if tokens.ndim != 1 or doc_offsets.ndim != 1:
        raise ManifestError(f"{where}: block {key} arrays must be 1-D")
    return tokens, doc_offsets


@dataclasses.dataclass
class TokenizerIdentity:
    """What a reader checks before it trusts the ids in a shard."""

    kind: str
    vocab_size: int
    fingerprint: str
    eos_id: int
    eod_id: int
    unk_id: int | None = None


@dataclasses.dataclass
class ShardEntry:
    path: str
    """File name relative to the manifest's directory, or a URL (``pipe:...``) for remote storage."""
    sha256: str
    bytes: int
    blocks: int
    documents: int
    """Documents that begin in this shard."""
    tokens: int
    """Tokens in this shard, document separators included."""
    token_offset: int
    """Global position of this shard's first token within its split's token stream."""
    block_offset: int
    """Global index of this shard's first block within its split."""
    block_tokens: list[int]
    """Tokens in each block, in order."""
    block_byte_offsets: list[int]
    """Byte offset, within the tar, of the header of each block's first member (for seeking in local files)."""
    words: int = 0
    """Whitespace-separated words of the raw text, plus one per document (its separator)."""
    characters: int = 0
    """Characters of the raw text, plus one per document (its separator)."""


@dataclasses.dataclass
class SplitEntry:
    documents: int
    tokens: int
    blocks: int
    shards: list[ShardEntry]
    words: int = 0
    characters: int = 0


@dataclasses.dataclass
class Manifest:
    tokenizer: TokenizerIdentity
    dtype: str
    block_tokens: int
    """The builder's target block size in tokens."""
    splits: dict[str, SplitEntry]
    build: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The settings of the build (inputs, document unit, ...), for the record and for ``--resume``."""
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object at the top level")
        if data.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: key 'format' is {data.get('format')!r}, expected {FORMAT_NAME!r}")
        if data.get("version") != FORMAT_VERSION:
            raise ManifestError(
                f"{where}: key 'version' is {data.get('version')!r}; this reader understands version {FORMAT_VERSION}"
            )
        tokenizer = _entry_from_dict(TokenizerIdentity, _get(data, "tokenizer", dict, where), f"{where}: tokenizer")
        splits = {}
        for name, split in _get(data, "splits", dict, where).items():
            split_where = f"{where}: splits.{name}"
            if not isinstance(split, dict):
                raise ManifestError(f"{split_where} must be an object")
            shards = [
                _entry_from_dict(ShardEntry, shard, f"{split_where}.shards[{i}]")
                for i, shard in enumerate(_get(split, "shards", list, split_where))
            ]
            fields = {k: v for k, v in split.items() if k != "shards"}
            splits[name] = _entry_from_dict(SplitEntry, {**fields, "shards": shards}, split_where)
        manifest = cls(
            tokenizer=tokenizer,
            dtype=_get(data, "dtype", str, where),
            block_tokens=_get(data, "block_tokens", int, where),
            splits=splits,
            build=data.get("build", {}),
        )
        manifest.validate(where)
        return manifest

    def validate(self, where: str) -> None:
        """Internal consistency: counts add up, offsets are contiguous, arrays have one entry per block."""
        if self.dtype not in ("uint16", "uint32"):
            raise ManifestError(f"{where}: key 'dtype' is {self.dtype!r}, expected 'uint16' or 'uint32'")
        if np.dtype(self.dtype) != token_dtype(self.tokenizer.vocab_size):
            raise ManifestError(
                f"{where}: key 'dtype' is {self.dtype} but vocab_size {self.tokenizer.vocab_size} "
                f"needs {token_dtype(self.tokenizer.vocab_size).name}"
            )
        for name, split in self.splits.items():
            token_offset = block_offset = 0
            for i, shard in enumerate(split.shards):
                at = f"{where}: splits.{name}.shards[{i}] ({shard.path})"
                if len(shard.block_tokens) != shard.blocks or len(shard.block_byte_offsets) != shard.blocks:
                    raise ManifestError(f"{at}: block_tokens/block_byte_offsets need {shard.blocks} entries")
                if sum(shard.block_tokens) != shard.tokens:
                    raise ManifestError(
                        f"{at}: block_tokens sum to {sum(shard.block_tokens)}, tokens is {shard.tokens}"
                    )
                if shard.token_offset != token_offset or shard.block_offset != block_offset:
                    raise ManifestError(
                        f"{at}: token_offset/block_offset are {shard.token_offset}/{shard.block_offset}, "
                        f"expected {token_offset}/{block_offset}"
                    )
                token_offset += shard.tokens
                block_offset += shard.blocks
            for key, total in (
                ("tokens", token_offset),
                ("blocks", block_offset),
                ("documents", sum(s.documents for s in split.shards)),
            ):
                if getattr(split, key) != total:
                    raise ManifestError(
                        f"{where}: splits.{name}.{key} is {getattr(split, key)}, the shards add up to {total}"
                    )


def _get(data: dict, key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise ManifestError(f"{where}: missing key '{key}'")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"{where}: key '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return value


def _entry_from_dict(cls: type, data: Any, where: str) -> Any:
    """The manifest entry ``cls`` (a dataclass) from its JSON object; a missing or unknown key is a ManifestError."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where} must be an object")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ManifestError(f"{where}: unknown key(s) {unknown}")
    try:
        return cls(**data)
    except TypeError as error:
        raise ManifestError(f"{where}: {error}") from error


def read_manifest(directory: str | os.PathLike) -> Manifest:
    path = Path(directory) / MANIFEST_NAME
    target = dangling_link(directory)
    if target is not None:  # not an interrupted build: nothing is there
        raise ManifestError(f"{directory}: a symbolic link to {target}, which leads nowhere (no shard directory)")
    if not path.is_file():
        raise ManifestError(
            f"{path}: no manifest; not a shard directory, or its build did not finish "
            f"(rerun data_tools.build_shards with --resume)"
        )
    return Manifest.from_dict(read_json(path, ManifestError), str(path))


def write_manifest(directory: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically: a reader sees the old file, or the whole new one, never a part."""
    directory = Path(directory)
    manifest.validate(str(directory / MANIFEST_NAME))
    text = json.dumps(manifest.to_dict(), indent=1, sort_keys=True) + "\n"
    return atomic_write_text(directory / MANIFEST_NAME, text)
