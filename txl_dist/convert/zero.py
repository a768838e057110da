"""A training checkpoint (DeepSpeed, any ZeRO stage, any number of ranks) -> fp32 weights and its run config.

Works offline, on one CPU process, on any machine that can read the folder: no process group, no GPU.

Trust: a checkpoint is verified first (every file against the sizes and CRC-32s of its ``COMPLETE.json``, see
`txl_dist.checkpoints.verify`), so a damaged one is refused rather than converted into plausible weights. Every
file is then read weights-only: ours directly, DeepSpeed's consolidation (``zero_to_fp32``, which asks for a full
unpickler) inside `txl_dist.checkpoints.weights_only.deepspeed_loads_weights_only`, which allows DeepSpeed's own
classes and nothing else. A crafted pickle is refused, never run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from txl_dist.checkpoint_paths import (
    CLIENT_KEY,
    COMPLETE,
    LATEST,
    has_optimizer_partitions,
    is_complete,
    model_state_files,
    named_by_latest,
    rank_state_path,
)
from txl_dist.checkpoints import weights_only
from txl_dist.checkpoints.verify import CheckpointVerificationError, read_marker, verify_checkpoint
from txl_dist.config import RunConfig
from txl_dist.data.format import ManifestError, read_manifest
from txl_dist.deepspeed_internals import consolidate_zero_checkpoint
from txl_dist.model import TransformerXLLM
from txl_dist.run_paths import checkpoints_dir
from txl_dist.tokenizer import find_tokenizer_dir


class CheckpointError(ValueError):
    """A path that is not a complete txl_dist training checkpoint; the message names the path and what is wrong."""


@dataclass
class TrainingCheckpoint:
    tag_dir: Path
    """The checkpoint folder (``.../checkpoints/step00001234``)."""
    client: dict[str, Any]
    """Our client state: step, tokens_seen, data, config, architecture, tokenizer, best, ..."""
    run_config: RunConfig

    @property
    def checkpoints_dir(self) -> Path:
        return self.tag_dir.parent

    @property
    def run_dir(self) -> Path:
        """The run's output directory (the parent of ``checkpoints/``)."""
        return self.checkpoints_dir.parent

    @property
    def tag(self) -> str:
        return self.tag_dir.name


def locate_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder for a run directory, a ``checkpoints/`` directory or a checkpoint folder itself."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    for candidate in (path, checkpoints_dir(path)):
        tag = named_by_latest(candidate)
        if tag is not None:
            if is_complete(candidate / tag):
                return candidate / tag
            raise CheckpointError(
                f"{candidate / LATEST} names {tag}, which is not a complete checkpoint (no {COMPLETE})"
            )
    if is_complete(path):
        return path
    if path.is_dir() and model_state_files(path):
        raise CheckpointError(
            f"{path}: a checkpoint folder without {COMPLETE}: its save did not finish, or it was "
            f"not written by txl_dist"
        )
    raise CheckpointError(
        f"{path}: not a txl_dist run, checkpoints directory or checkpoint folder (no {LATEST} and no {COMPLETE})"
    )


def require_verified(tag_dir: str | os.PathLike) -> None:
    """Raise CheckpointError listing every problem when the checkpoint's files do not match its COMPLETE.json."""
    problems = verify_checkpoint(tag_dir)
    if problems:
        raise CheckpointError(
            f"{tag_dir} fails verification and is not read: {'; '.join(problems)} (choose an "
            f"earlier checkpoint folder, or pass --no-verify to read it all the same)"
        )


def read_training_checkpoint(path: str | os.PathLike, verify: bool = True) -> TrainingCheckpoint:
    """The checkpoint of a run folder, a checkpoints/ folder or a checkpoint folder, verified unless ``verify``
    is False (`require_verified`)."""
    tag_dir = locate_checkpoint(path)
    if verify:
        require_verified(tag_dir)
    try:
        marker = read_marker(tag_dir)
    except CheckpointVerificationError as error:
        raise CheckpointError(str(error)) from None
    for rank in range(marker["world_size"]):
        rank_file = rank_state_path(tag_dir, rank)
        if not rank_file.is_file():
            raise CheckpointError(f"{rank_file}: missing from a checkpoint marked complete")
    model_states = model_state_files(tag_dir)
    if not model_states:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed model-state file (*model_states.pt)")
    state = weights_only.load(model_states[0], map_location="cpu")
    if CLIENT_KEY not in state:
        raise CheckpointError(f"{model_states[0]}: no '{CLIENT_KEY}' client state; not written by txl_dist")
    client = state[CLIENT_KEY]
    run_config = RunConfig.from_dict(client["config"], where=f"the config stored in {model_states[0]}")
    return TrainingCheckpoint(tag_dir=tag_dir, client=client, run_config=run_config)


def consolidate_weights(checkpoint: TrainingCheckpoint, progress: bool = True) -> dict[str, torch.Tensor]:
    """The full fp32 state dict, gathered from every rank's partitions (tied weights appear once). ``progress``:
    DeepSpeed's bars while it gathers ZeRO 1-3 partitions."""
    tag_dir = checkpoint.tag_dir
    if has_optimizer_partitions(tag_dir):
        with weights_only.deepspeed_loads_weights_only():
            return consolidate_zero_checkpoint(checkpoint.checkpoints_dir, checkpoint.tag, progress=progress)
    # ZeRO stage 0: everything is in the model-state file.
    path = model_state_files(tag_dir)[0]
    state = weights_only.load(path, map_location="cpu")
    optimizer = state.get("optimizer") or {}
    masters = _fp32_masters(optimizer, checkpoint.run_config.model, path)
    if masters is not None:
        return masters
    return {name: tensor.float() for name, tensor in state["module"].items()}


def _fp32_masters(optimizer: dict[str, Any], config, where: Path) -> dict[str, torch.Tensor] | None:
    """The fp32 master weights a ZeRO-0 bf16/fp16 optimizer keeps (the module holds rounded copies), by name;
    None when training was in fp32. The trainer gives DeepSpeed ``model.parameters()`` as one group, so the
    masters follow the order of ``named_parameters()``."""
    if "fp32_groups" in optimizer:
        flat_masters = [t for group in optimizer["fp32_groups"] for t in group]
    elif "fp32_groups_flat" in optimizer:
        flat_masters = list(optimizer["fp32_groups_flat"])
    else:
        return None
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in TransformerXLLM(config).named_parameters()]
    if len(flat_masters) == len(shapes):
        tensors = flat_masters
    else:  # one flat tensor per group: cut it into the parameters, in order
        flat = torch.cat([t.flatten() for t in flat_masters])
        sizes = [shape.numel() for _, shape in shapes]
        if flat.numel() != sum(sizes):
            raise CheckpointError(
                f"{where}: the optimizer's fp32 masters hold {flat.numel()} values, the model {sum(sizes)}"
            )
        tensors = list(flat.split(sizes))
    masters = {}
    for (name, shape), tensor in zip(shapes, tensors):
        if tensor.numel() != shape.numel():
            raise CheckpointError(f"{where}: fp32 master for {name} has {tensor.numel()} values, expected {shape}")
        masters[name] = tensor.float().reshape(shape).clone()
    return masters


def find_tokenizer(checkpoint: TrainingCheckpoint, explicit: str | os.PathLike | None = None) -> Path:
    """The tokenizer folder of the fingerprint the run recorded.

    ``explicit`` must match it. Otherwise the candidates are the run's own copy (``{run}/tokenizer``, written by
    the trainer), the run's ``data.tokenizer`` and the folder the shards were built with (the manifest's build
    record); the first one whose files hash to the recorded fingerprint is used.
    """
    wanted = checkpoint.client["tokenizer"]["fingerprint"]
    if explicit is not None:
        return find_tokenizer_dir(wanted, [explicit], strict=True)
    data = checkpoint.run_config.data
    return find_tokenizer_dir(
        wanted, [checkpoint.run_dir / "tokenizer", data.tokenizer, *_shards_tokenizer(data.shards)]
    )


def _shards_tokenizer(shards: str | None) -> list[str]:
    if shards is None or "://" in shards or shards.startswith("pipe:"):
        return []
    try:
        directory = read_manifest(shards).build.get("tokenizer_directory")
    except (ManifestError, OSError):
        return []
    return [directory] if directory else []
