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
    is resolved: `txl_dist.training.cli.parse_run_args` for training, which hands the Trainer the result."""
    if manifest is None:
        manifest = shards_manifest(cfg)
        if manifest is None:
            return cfg
    return with_manifest_vocab(cfg, manifest.tokenizer.vocab_size, _where(cfg))


def require_shards_vocab(cfg: RunConfig, manifest: Manifest) -> None:
    """ValueError unless model.n_token is the vocabulary of the shards' ``manifest``: the Trainer's check that it
    was handed a config resolved by `with_shards_vocab` against these shards."""
    if cfg.model.n_token != manifest.tokenizer.vocab_size:
        raise ValueError(
            f"model.n_token={cfg.model.n_token}, but {_where(cfg)} has vocab_size {manifest.tokenizer.vocab_size}: "
            f"resolve the config with txl_dist.data.run_vocab.with_shards_vocab (parse_run_args does)"
        )


def _where(cfg: RunConfig) -> str:
    return f"the manifest {os.path.join(cfg.data.shards, MANIFEST_NAME)}"
