"""What a shard build is asked for: its settings (which determine the shards), their checks, and the held-out split."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path
from typing import Any

from data_tools.corpora import chunking
from data_tools.corpora.inputs import InputFile
from data_tools.errors import InputError
from txl_dist.tokenizer import Tokenizer

DEFAULT_TOKENS_PER_BLOCK = 1 << 16
DEFAULT_TOKENS_PER_SHARD = 1 << 24
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")


@dataclasses.dataclass(frozen=True)
class Holdout:
    """Documents of split ``source`` whose hash falls below ``fraction`` go to split ``split`` instead."""

    split: str
    fraction: float
    source: str = "train"

    def takes(self, document: list[str]) -> bool:
        # surrogatepass: the lines of a byte tokenizer's documents hold the bytes that are not UTF-8 as lone
        # surrogates (and a JSON string may hold any); text that is UTF-8 hashes as before.
        text = "\n".join(document).encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(text, digest_size=8).digest()
        return int.from_bytes(digest, "little") < self.fraction * 2.0**64


@dataclasses.dataclass
class BuildSettings:
    """Everything that determines the shards (the worker count does not)."""

    tokenizer_directory: Path
    sources: dict[str, list[InputFile]]
    """Split name -> input files, in build order."""
    input_format: str = "text"
    doc_unit: str = "line"
    jsonl_field: str = "text"
    strict: bool = False
    holdout: Holdout | None = None
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES
    """Bytes of text per unit of work; part of the settings because resume positions count chunks."""

    def __post_init__(self) -> None:
        for name in self.splits():
            if not SPLIT_NAME.match(name):
                raise InputError(f"split name {name!r}: use letters, digits and '_' only")
        if not self.sources:
            raise InputError("no split to build: give --split NAME=GLOB (or --format lm1b|ptb)")
        if self.doc_unit not in chunking.DOC_UNITS:
            raise InputError(f"--doc-per {self.doc_unit!r}: expected one of {list(chunking.DOC_UNITS)}")
        for flag, value in (
            ("--tokens-per-block", self.tokens_per_block),
            ("--chunk-bytes", self.chunk_bytes),
            ("--tokens-per-shard", self.tokens_per_shard),
        ):
            if value <= 0:
                raise InputError(f"{flag} {value}: must be positive")
        if self.tokens_per_shard < self.tokens_per_block:
            raise InputError(
                f"--tokens-per-shard {self.tokens_per_shard} is smaller than --tokens-per-block {self.tokens_per_block}"
            )
        if self.holdout is not None:
            if not 0.0 < self.holdout.fraction < 1.0:
                raise InputError(
                    f"--holdout {self.holdout.split}={self.holdout.fraction}: the fraction must lie in (0, 1)"
                )
            if self.holdout.source not in self.sources:
                raise InputError(f"--holdout takes documents from split '{self.holdout.source}', which is not built")
            if self.holdout.split in self.sources:
                raise InputError(
                    f"--holdout {self.holdout.split}=...: split '{self.holdout.split}' also has inputs; "
                    f"drop one of the two"
                )

    def streams_of(self, source: str) -> list[str]:
        """The splits fed by the documents of ``source``."""
        holdout = self.holdout
        return [source, holdout.split] if holdout is not None and holdout.source == source else [source]

    def splits(self) -> list[str]:
        return [split for source in self.sources for split in self.streams_of(source)]

    def record(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """The settings as JSON (for the manifest's ``build`` and the ``--resume`` check)."""
        return {
            "builder": "data_tools.build_shards",
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "format": self.input_format,
            "inputs": {split: [f.describe() for f in files] for split, files in self.sources.items()},
            "doc_per": self.doc_unit,
            "jsonl_field": self.jsonl_field,
            "strict": self.strict,
            "holdout": dataclasses.asdict(self.holdout) if self.holdout else None,
            "tokens_per_block": self.tokens_per_block,
            "tokens_per_shard": self.tokens_per_shard,
            "chunk_bytes": self.chunk_bytes,
        }
