"""Training checkpoints: DeepSpeed's engine checkpoint plus what DeepSpeed does not know about.

A checkpoint is the folder ``{directory}/{tag}`` (tag ``step00001234``) holding

- DeepSpeed's files (module, ZeRO optimizer partitions, LR scheduler), with the run's client state inside: step,
  tokens seen, the data position, the resolved config, the best validation result so far;
- ``txl_rank_states/rank{r:05d}.pt`` per rank: the memory of every stream the rank owned (by global stream id)
  and the rank's random-number-generator states;
- ``COMPLETE.json``, written by rank 0 only after every rank has finished writing.

``{directory}/latest`` names the newest complete checkpoint and is replaced atomically after ``COMPLETE.json``.
(DeepSpeed's own ``latest`` is written by rank 0 without waiting for the other ranks' optimizer files, so it is
turned off.) A folder without ``COMPLETE.json`` is a save that was interrupted: it is never resumed from, and the
next run removes it. The last ``keep_last`` complete checkpoints are kept (all with 0), and the best one by
validation loss.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from txl_dist.fileio import atomic_write, atomic_write_text

log = logging.getLogger("txl_dist.training")

CLIENT_KEY = "txl_dist"
"""The key of our client state inside DeepSpeed's model-state file."""
LATEST = "latest"
COMPLETE = "COMPLETE.json"
RANK_STATES = "txl_rank_states"
_TAG_RE = re.compile(r"step(\d{8})")


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def rng_state() -> dict[str, Any]:
    """This process's generator states, in types that ``torch.load(weights_only=True)`` accepts."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
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


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, keep_last: int):
        self.directory = Path(directory)
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last

    # ---- finding checkpoints -----------------------------------------------------------------------------------

    def complete_tags(self) -> list[str]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        tags = [p.name for p in self.directory.iterdir() if _TAG_RE.fullmatch(p.name) and (p / COMPLETE).is_file()]
        return sorted(tags)

    def latest_tag(self) -> str | None:
        """The checkpoint to resume from: the one ``latest`` names, which must be complete."""
        latest = self.directory / LATEST
        if latest.is_file():
            tag = latest.read_text(encoding="utf-8").strip()
            if (self.directory / tag / COMPLETE).is_file():
                return tag
            log.warning("%s names %s, which is not a complete checkpoint; looking for the newest complete one",
                        latest, tag)
        tags = self.complete_tags()
        return tags[-1] if tags else None

    def remove_incomplete(self) -> None:
        """Rank 0, before training: delete the folders of saves that were interrupted."""
        if self.rank != 0 or not self.directory.is_dir():
            return
        for path in self.directory.iterdir():
            if _TAG_RE.fullmatch(path.name) and path.is_dir() and not (path / COMPLETE).is_file():
                log.warning("removing %s: an interrupted save (no %s)", path, COMPLETE)
                shutil.rmtree(path, ignore_errors=True)

    # ---- saving ------------------------------------------------------------------------------------------------

    def save(self, engine, step: int, client_state: dict[str, Any], rank_state: RankState,
             architecture: dict[str, Any], best_tag: str | None = None) -> str:
        """Collective: every rank calls it at the same step. ``architecture`` goes into COMPLETE.json, where a
        resuming run checks it before building anything."""
        tag = tag_for_step(step)
        if self.rank == 0 and (self.directory / tag).exists():
            # A folder of this name from an earlier attempt (an interrupted save, or a run that did not resume):
            # its files must not mix with this save's, nor can it stay marked complete meanwhile.
            shutil.rmtree(self.directory / tag)
        dist.barrier()
        engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state, save_latest=False)
        states_dir = self.directory / tag / RANK_STATES
        states_dir.mkdir(parents=True, exist_ok=True)
        state = {"stream_ids": torch.tensor(rank_state.stream_ids, dtype=torch.long), "mems": rank_state.mems,
                 "rng": rank_state.rng, "world_size": rank_state.world_size, "rank": rank_state.rank}
        atomic_write(states_dir / f"rank{self.rank:05d}.pt", lambda handle: torch.save(state, handle))
        # Every rank has written DeepSpeed's files and its own before the checkpoint is declared complete.
        dist.barrier()
        if self.rank == 0:
            # Rank r owns streams [r * n, (r + 1) * n): a resuming rank opens only the files of its streams.
            marker = {"step": step, "world_size": self.world_size, "streams_per_rank": len(rank_state.stream_ids),
                      "rank_states": sorted(p.name for p in states_dir.glob("rank*.pt")),
                      "architecture": architecture}
            atomic_write_text(self.directory / tag / COMPLETE, json.dumps(marker, indent=1) + "\n")
            atomic_write_text(self.directory / LATEST, tag + "\n")
            # DeepSpeed writes this pointer when the run resumed through a universal checkpoint; ours is `latest`.
            (self.directory / "latest_universal").unlink(missing_ok=True)
            self._prune(keep={tag, best_tag} - {None})
        dist.barrier()
        return tag

    def _prune(self, keep: set[str]) -> None:
        if self.keep_last == 0:  # keep every checkpoint
            return
        tags = self.complete_tags()
        for tag in tags[: max(0, len(tags) - self.keep_last)]:
            if tag not in keep:
                shutil.rmtree(self.directory / tag, ignore_errors=True)

    # ---- loading -----------------------------------------------------------------------------------------------

    def marker(self, tag: str) -> dict[str, Any]:
        """The COMPLETE.json of a checkpoint: step, world_size, streams_per_rank, rank_states, architecture."""
        return json.loads((self.directory / tag / COMPLETE).read_text(encoding="utf-8"))

    def saved_world_size(self, tag: str) -> int:
        return self.marker(tag)["world_size"]

    def needs_universal(self, tag: str) -> bool:
        """True when ``tag`` holds optimizer partitions for another number of ranks than this run has.

        DeepSpeed cannot re-partition ZeRO optimizer states for a new data-parallel size; its universal checkpoint
        format can, so such a checkpoint is converted (`prepare_universal`) and loaded with ``load_universal``."""
        partitioned = any((self.directory / tag).glob("*optim_states.pt"))
        return partitioned and self.saved_world_size(tag) != self.world_size

    def prepare_universal(self, tag: str) -> str:
        """Collective: rank 0 converts ``tag`` to DeepSpeed's universal format; returns the converted tag."""
        universal = f"{tag}_universal"
        if self.rank == 0:
            import argparse

            from deepspeed.checkpoint import ds_to_universal

            target = self.directory / universal
            shutil.rmtree(target, ignore_errors=True)
            log.info("converting %s (%d ranks) to DeepSpeed's universal format for %d ranks",
                     self.directory / tag, self.saved_world_size(tag), self.world_size)
            ds_to_universal.main(argparse.Namespace(
                input_folder=str(self.directory / tag), output_folder=str(target), num_extract_workers=1,
                num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
            ))
        dist.barrier()
        return universal

    def remove_universal(self, universal: str) -> None:
        """Collective: after every rank has loaded it, the converted copy goes."""
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(self.directory / universal, ignore_errors=True)

    def load_rank_states(self, tag: str, stream_ids: list[int]) -> tuple[dict[int, list[torch.Tensor]], dict | None]:
        """Mems of the given streams (by stream id, each a list of n_layer + 1 tensors [mem_len, d_model]) and,
        when the checkpoint was written by the same number of ranks, this rank's RNG state."""
        states_dir = self.directory / tag / RANK_STATES
        marker = self.marker(tag)
        per_rank, saved_world = marker["streams_per_rank"], marker["world_size"]
        wanted = set(stream_ids)
        mems: dict[int, list[torch.Tensor]] = {}
        rng = None
        for saved_rank in range(saved_world):
            owned = range(saved_rank * per_rank, (saved_rank + 1) * per_rank)
            same_rank = saved_world == self.world_size and saved_rank == self.rank
            if not same_rank and not wanted.intersection(owned):
                continue
            path = states_dir / f"rank{saved_rank:05d}.pt"
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing from a checkpoint marked complete; the checkpoint is damaged")
            state = torch.load(path, map_location="cpu", weights_only=True)
            if same_rank:
                rng = state["rng"]
            if state["mems"] is None:
                continue
            for column, stream_id in enumerate(state["stream_ids"].tolist()):
                if stream_id in wanted:
                    mems[stream_id] = [layer[:, column] for layer in state["mems"]]
        return mems, rng
