"""Checkpoint files written by a thread while training goes on (checkpoint.background).

A save copies what each file holds into host memory (`host_copy`: every tensor copied, so the next optimizer step
cannot change what is written) and hands the copies to one `BackgroundWrite`, a thread that writes each file as
the synchronous save does (temporary name, fsync, rename, CRC-32 of the bytes as they pass), reads it back to check
that CRC, and records the checksums. Training waits only for the copy (the *stall*). The checkpoint becomes
COMPLETE when every rank's write has ended and been checked (`txl_dist.checkpoints.manager.CheckpointManager`);
until then it is an unfinished save, which a kill leaves behind and the next start removes, so the newest
verified checkpoint is still the one before. At most one write is in flight: a save waits for the previous one.

Why not DeepSpeed's own engines: its FastCheckpointEngine is a synchronous writer (training waits for it), fast
through DeepNVMe's asynchronous I/O op (libaio, O_DIRECT, built for GPU nodes); its DecoupledCheckpointEngine
runs that engine in a helper process and hands it each file's state through torch.multiprocessing, which moves the
tensors themselves into shared memory (DeepSpeed passes the ZeRO optimizer's live state, so a write can see a
later step's values unless the state is copied first), and neither writes under a temporary name with a checksum
of the bytes, which is what makes a txl_dist checkpoint verifiable. Measured side by side
(benchmarks/checkpoint_stall.py --deepspeed-decoupled, benchmarks/RESULTS.md), its hand-over kept training
waiting about 4.5 times as long as this copy. A thread beside the recording engine keeps the one write path
(`txl_dist.fileio.atomic_write_checksummed`) for both kinds of save.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from txl_dist.fileio import FileChecksum, atomic_write_checksummed, file_checksum, with_path


def host_copy(value: Any, buffers: HostBuffers | None = None, key: tuple = ()) -> Any:
    """VALUE with every tensor in it copied to host memory (detached, a storage of its own each: into BUFFERS'
    tensor for its KEY when one is kept), containers rebuilt, and anything else deep-copied: what a file will
    hold, fixed at this moment."""
    if isinstance(value, torch.Tensor):
        if buffers is None:
            return value.detach().to("cpu", copy=True)
        return buffers.copy(key, value.detach())
    if isinstance(value, dict):
        copied = type(value)() if type(value) is not dict else {}
        for name, item in value.items():
            copied[name] = host_copy(item, buffers, (*key, name))
        return copied
    if isinstance(value, list):
        return [host_copy(item, buffers, (*key, index)) for index, item in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(host_copy(item, buffers, (*key, index)) for index, item in enumerate(value))
    return copy.deepcopy(value)


class HostBuffers:
    """The host tensors of the last background save, reused by the next one: a save then costs training one
    memory copy, not the allocation of fresh memory as well (the kernel zeroes every new page first, which on a
    CPU took longer than the copy itself: benchmarks/checkpoint_stall.py). Reusing them is safe because a save
    waits for the previous write before it copies (at most one in flight); they hold one copy of the rank's
    state for the rest of the run."""

    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}

    def copy(self, key: tuple, source: torch.Tensor) -> torch.Tensor:
        buffer = self._tensors.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu")
            self._tensors[key] = buffer
        buffer.copy_(source)
        return buffer


@dataclass
class FileJob:
    """One file of a save: where it goes and what writes its bytes to an open handle."""

    path: str
    write: Callable[[BinaryIO], object]


@dataclass
class BackgroundWrite:
    """The files of one save, written one after another by a thread (`start`); `written` maps each absolute path
    to its checksum once the thread is done, `error` holds its failure (an OSError naming the file)."""

    jobs: list[FileJob]
    written: dict[str, FileChecksum] = field(default_factory=dict)
    error: BaseException | None = None
    seconds: float = 0.0
    """How long the thread took to write and check every file."""
    _thread: threading.Thread | None = None

    def start(self) -> BackgroundWrite:
        self._thread = threading.Thread(target=self._run, name="txl_dist-checkpoint-writer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            for job in self.jobs:
                Path(job.path).parent.mkdir(parents=True, exist_ok=True)
                checksum = atomic_write_checksummed(job.path, job.write)
                on_disk = file_checksum(job.path)
                if on_disk != checksum:
                    raise OSError(
                        f"{job.path}: read back as {on_disk.bytes} bytes, CRC-32 {on_disk.crc32}, but "
                        f"{checksum.bytes} bytes, CRC-32 {checksum.crc32} were written"
                    )
                self.written[os.path.abspath(job.path)] = checksum
        except BaseException as error:  # noqa: BLE001 -- handed to the training thread, which fails the run
            self.error = with_path(error, job.path) if isinstance(error, OSError) else error
        finally:
            self.jobs = []  # the host copies go as soon as they are written
            self.seconds = time.perf_counter() - began

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


def torch_save_job(path: str, state: Any, zipfile_serialization: bool = True) -> FileJob:
    """A `FileJob` that writes STATE (already a host copy) with torch.save."""

    def write(handle: BinaryIO) -> None:
        torch.save(state, handle, _use_new_zipfile_serialization=zipfile_serialization)

    return FileJob(path, write)
