"""The run's vocabulary, resolved where the data is opened: model.n_token from the shards' manifest (the
configuration itself imports nothing of the data)."""

from __future__ import annotations

import os

from txl_dist.config import RunConfig, with_manifest_vocab
from txl_dist.data.format import MANIFEST_NAME, Manifest, read_manifest


def with_shards_vocab(cfg: RunConfig, manifest: Manifest | None = None) -> RunConfig:
    """`txl_dist.config.with_manifest_vocab` with the manifest of data.shards (``manifest``, when the caller has
    read it), when there is one; else the config as it is (the command line and the planner check a config
    before, or without, the shards)."""
    if manifest is None:
        if cfg.data.shards is None or not os.path.isfile(os.path.join(cfg.data.shards, MANIFEST_NAME)):
            return cfg
        manifest = read_manifest(cfg.data.shards)
    where = f"the manifest {os.path.join(cfg.data.shards, MANIFEST_NAME)}"
    return with_manifest_vocab(cfg, manifest.tokenizer.vocab_size, where)
