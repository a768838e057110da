"""A checkpoint's per-rank state: the memory of every stream a rank owned, by stream id, and its RNG states.

Rank r of a run with n streams per rank owns streams [r * n, (r + 1) * n) and writes
``txl_rank_states/rank{r:05d}.pt`` (`txl_dist.checkpoint_paths.rank_state_path`); a resuming rank opens
only the files of the streams it now owns, and its own file's RNG states when the number of ranks is the same.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txl_dist.checkpoint_paths import rank_state_path
from txl_dist.checkpoints import weights_only
from txl_dist.checkpoints.background import FileJob, torch_save_job
from txl_dist.fileio import FileChecksum, atomic_write_checksummed


def dropout_seed(seed: int, rank: int, step: int = 0) -> int:
    """The torch seed of ``rank``'s dropout at ``step``: at the start of a run (step 0), and after a resume whose
    saved RNG states do not map onto this run's ranks. Each rank's stream differs from every other's, and from
    the one all ranks share while the model is built (``seed`` itself: identical initial weights)."""
    return seed + 1_000_003 * rank + 7919 * step


def rng_state() -> dict[str, Any]:
    """This process's generator states, in types that ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class RankState:
    """What one rank saves besides DeepSpeed's files."""

    stream_ids: list[int]
    mems: list[torch.Tensor] | None
    """n_layer + 1 tensors [mem_len, len(stream_ids), d_model], columns in the order of stream_ids; None before
    the first step."""
    rng: dict[str, Any]
    world_size: int
    rank: int


def _rank_state_file(tag_dir: Path, rank_state: RankState) -> tuple[Path, dict[str, Any]]:
    state_path = rank_state_path(tag_dir, rank_state.rank)
    state = {
        "stream_ids": torch.tensor(rank_state.stream_ids, dtype=torch.long),
        "mems": rank_state.mems,
        "rng": rank_state.rng,
        "world_size": rank_state.world_size,
        "rank": rank_state.rank,
    }
    return state_path, state


def write_rank_state(tag_dir: Path, rank_state: RankState) -> dict[str, FileChecksum]:
    """The rank's state file in checkpoint ``tag_dir``; returns its checksum by absolute path."""
    state_path, state = _rank_state_file(tag_dir, rank_state)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    checksum = atomic_write_checksummed(state_path, lambda handle: torch.save(state, handle))
    return {os.path.abspath(state_path): checksum}


def rank_state_job(tag_dir: Path, rank_state: RankState) -> FileJob:
    """The rank's state file as a job of a background save (RANK_STATE already a host copy)."""
    state_path, state = _rank_state_file(tag_dir, rank_state)
    return torch_save_job(str(state_path), state)


def read_rank_states(
    tag_dir: Path, marker: dict[str, Any], rank: int, world_size: int, stream_ids: list[int]
) -> tuple[dict[int, list[torch.Tensor]], dict | None]:
    """Mems of the given streams (by stream id, each a list of n_layer + 1 tensors [mem_len, d_model]) and,
    when the checkpoint (its COMPLETE.json: ``marker``) was written by ``world_size`` ranks, the RNG state of
    ``rank``."""
    per_rank, saved_world = marker["streams_per_rank"], marker["world_size"]
    wanted = set(stream_ids)
    mems: dict[int, list[torch.Tensor]] = {}
    rng = None
    for saved_rank in range(saved_world):
        owned = range(saved_rank * per_rank, (saved_rank + 1) * per_rank)
        same_rank = saved_world == world_size and saved_rank == rank
        if not same_rank and not wanted.intersection(owned):
            continue
        path = rank_state_path(tag_dir, saved_rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from a checkpoint marked complete; the checkpoint is damaged")
        state = weights_only.load(path, map_location="cpu")
        if same_rank:
            rng = state["rng"]
        if state["mems"] is None:
            continue
        for column, stream_id in enumerate(state["stream_ids"].tolist()):
            if stream_id in wanted:
                mems[stream_id] = [layer[:, column] for layer in state["mems"]]
    return mems, rng
