"""Shards of synthetic tokens for the stream tests: token value = its position in the split.

Every token is unique, so "each token exactly once" and "row b continues where it ended" are checks on
integers. Blocks have random lengths, so windows cross block and shard boundaries everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_tools.shards.writer import ShardWriter
from txl_dist.data.format import Manifest, SplitEntry, TokenizerIdentity, token_dtype, write_manifest

VOCAB_SIZE = 10**7
FINGERPRINT = "a" * 64


def write_position_shards(
    directory: str | Path,
    split_tokens: dict[str, int],
    *,
    seed: int = 0,
    block_range: tuple[int, int] = (37, 400),
    tokens_per_shard: int = 3000,
    fingerprint: str = FINGERPRINT,
    vocab_size: int = VOCAB_SIZE,
) -> Manifest:
    """Write one split per entry of ``split_tokens`` (name -> token count) and the manifest; return it.

    ``vocab_size`` must exceed the largest split's token count; up to 65,536 the tokens are stored as uint16.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = token_dtype(vocab_size)
    splits = {}
    for split, num_tokens in split_tokens.items():
        writer = ShardWriter(directory, split, vocab_size, dtype, tokens_per_shard)
        position = 0
        while position < num_tokens:
            length = min(int(rng.integers(*block_range)), num_tokens - position)
            writer.add_block(np.arange(position, position + length), np.array([0]))
            position += length
        shards = writer.close()
        splits[split] = SplitEntry(
            documents=sum(s.documents for s in shards),
            tokens=num_tokens,
            blocks=sum(s.blocks for s in shards),
            shards=shards,
        )
    tokenizer = TokenizerIdentity(kind="synthetic", vocab_size=vocab_size, fingerprint=fingerprint, eos_id=0, eod_id=0)
    manifest = Manifest(tokenizer=tokenizer, dtype=dtype.name, block_tokens=block_range[1], splits=splits)
    write_manifest(directory, manifest)
    return manifest
