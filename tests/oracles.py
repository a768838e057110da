"""What the launcher tests compare a run with, computed without the code under test where it can be: a split's
token stream read with webdataset alone, and the model of a checkpoint."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch


def stream_tokens(shards: Path, split: str) -> torch.Tensor:
    """A split's token stream, read with webdataset (not with txl_dist.data)."""
    import webdataset as wds

    manifest = json.loads((shards / "manifest.json").read_text())
    urls = [str(shards / shard["path"]) for shard in manifest["splits"][split]["shards"]]
    blocks = [np.load(io.BytesIO(sample["tokens.npy"])) for sample in wds.WebDataset(urls, shardshuffle=False)]
    return torch.from_numpy(np.concatenate(blocks).astype(np.int64))


def checkpoint_model(output_dir: Path, tag: str | None = None, **settings):
    """The model of a run's checkpoint (its latest, or ``tag``), weights gathered from the ZeRO partitions, in eval
    mode, with evaluation ``settings`` (mem_len, ...) applied."""
    from txl_dist.convert.zero import consolidate_weights, read_training_checkpoint
    from txl_dist.export import apply_eval_overrides, model_from_state_dict

    checkpoint = read_training_checkpoint(output_dir / "checkpoints" / tag if tag else output_dir)
    config = apply_eval_overrides(checkpoint.run_config.model, settings)
    return model_from_state_dict(consolidate_weights(checkpoint), config), checkpoint
