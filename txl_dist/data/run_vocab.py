"""The run's vocabulary, resolved where the data is opened: model.n_token from the shards' manifest (the
configuration itself imports nothing of the data)."""

from __future__ import annotations

import os

from txl_dist.config import RunConfig, with_manifest_vocab
from txl_dist.data.format import MANIFEST_NAME, Manifest, read_manifest


def shards_manifest(cfg: RunConfig) -> Manifest | None:
    """The manifest of data.shards; None while data.shards is unset or holds no manifest (the command line and
    the planner check a config before, or without, the shards)."""
    if cfg.data.shards is None or not os.path.isfile(os.path.join(cfg.data.shards, MANIFEST_NAME)):
        return None
    return read_manifest(cfg.data.shards)


def with_shards_vocab(cfg: RunConfig, manifest: Manifest | None = None) -> RunConfig:
    """`txl_dist.config.with_manifest_vocab` with the manifest of data.shards (``manifest``, when the caller has
    read it; else `shards_manifest`); the config as it is where there is none. The one place a run's vocabulary
    is resolved: `txl_dist.training.startup.resolve` for training, which hands the Trainer the result."""
    if manifest is None:
        manifest = shards_manifest(cfg)
        if manifest is None:
            return cfg
    return with_manifest_vocab(cfg, manifest.tokenizer.vocab_size, _where(cfg))


def _where(cfg: RunConfig) -> str:
    return f"the manifest {os.path.join(cfg.data.shards, MANIFEST_NAME)}"
