"""DeepSpeed's checkpoint files, written the way every txl_dist file is: `RecordingCheckpointEngine` wraps the
engine DeepSpeed was configured with (`txl_dist.deepspeed_internals.CheckpointEngineWrapper`), so that each file is
written under a temporary name, synced and renamed, with its size and CRC-32 recorded from the bytes as they are
written (a checkpoint costs no second read), and read weights-only. A background save or a memory snapshot
(`txl_dist.checkpoints.background`, `txl_dist.checkpoints.snapshots`) defers the files instead: each one's state,
host-copied for a background save, becomes a job that writes it later."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from txl_dist.checkpoints import weights_only
from txl_dist.checkpoints.background import FileJob, HostBuffers, host_copy, torch_save_job
from txl_dist.deepspeed_internals import CheckpointEngineWrapper
from txl_dist.fileio import FileChecksum, atomic_write_checksummed


class RecordingCheckpointEngine(CheckpointEngineWrapper):
    """DeepSpeed's checkpoint engine, but every file is written atomically (temporary name, fsync, rename) with
    its size and CRC-32 recorded as the bytes pass, and read weights-only (`txl_dist.checkpoints.weights_only`)."""

    def __init__(self, inner: Any):
        super().__init__(inner)
        self.written: dict[str, FileChecksum] = {}
        self.deferred: list[FileJob] | None = None
        """While a background save or a memory snapshot collects its files: each one's state, for a thread or
        for memory, a host copy of it when `copy_deferred` (a background save: training goes on meanwhile)."""
        self.copy_deferred = True
        self.buffers = HostBuffers()
        """The host copies of the background saves, reused from one save to the next."""

    def save(self, state_dict: Any, path: str) -> None:
        zip_format = self.zipfile_serialization
        if self.deferred is not None:
            name = Path(path).name
            state = host_copy(state_dict, self.buffers, (name,)) if self.copy_deferred else state_dict
            self.deferred.append(torch_save_job(path, state, zip_format))
            return
        self.written[os.path.abspath(path)] = atomic_write_checksummed(
            path, lambda handle: torch.save(state_dict, handle, _use_new_zipfile_serialization=zip_format)
        )

    def load(self, path: str, map_location: Any = None) -> Any:
        return weights_only.load(path, map_location=map_location)
