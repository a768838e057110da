"""The run's output directory: rank 0's lock on it, the proof that every rank sees it, the tokenizer kept in it,
and the check before start-up that it can be written (`require_writable`).

The run owns its output directory: rank 0 holds ``run.lock`` (`txl_dist.supervision.lock`) from start to exit,
and every rank must read back that lock's token before anything else happens, which proves that all nodes see the
same directory (nodes that see different directories would resume from different checkpoints and hang in their
first collective). A copy of the tokenizer in ``{output_dir}/tokenizer`` lets checkpoints convert and evaluate on
any machine without the shards' build folders.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from txl_dist.exit_status import USAGE_ERROR, CommandFailure, os_error_status
from txl_dist.fileio import dangling_link, describe_os_error, make_temporary_directory
from txl_dist.rendezvous.ranks import broadcast
from txl_dist.run_paths import CHECKPOINTS, PROFILE, TENSORBOARD, checkpoints_dir
from txl_dist.supervision.guard import RunFailure, RunGuard
from txl_dist.supervision.lock import LOCK_NAME, RunLock, read_holder
from txl_dist.tokenizer import TokenizerError, find_tokenizer_dir, load_tokenizer

log = logging.getLogger("txl_dist.training")

SHARED_DIRECTORY_WAIT_S = 10.0
"""How long a rank looks for rank 0's lock file before it decides that its node sees another directory (NFS
clients may cache a lookup for a few seconds)."""


class RunDirectory:
    """``train.output_dir`` once this run holds it (`take`): the lock on rank 0, None on the others."""

    def __init__(self, path: Path, lock: RunLock | None):
        self.path = path
        self.lock = lock

    @property
    def checkpoints(self) -> Path:
        return checkpoints_dir(self.path)

    @classmethod
    def take(cls, path: str | os.PathLike, rank: int, world_size: int, guard: RunGuard) -> RunDirectory:
        """Collective: rank 0 takes the run lock (refused while another run holds it; released if the run fails);
        then every rank must read that lock, token and all, from its own view of the directory, or the run
        stops with a RunFailure naming the ranks that could not."""
        path = Path(path)
        lock = None
        if rank == 0:
            lock = RunLock(path, on_lost=lambda message: guard.fail(RunFailure(message)))
            lock.acquire()
            guard.on_abort(lock.release)
        token, rank0_dir, rank0_host = broadcast(
            (lock.token, str(path.absolute()), socket.gethostname()) if lock else None
        )
        problem = None
        if rank != 0:
            problem = _find_lock(path / LOCK_NAME, token, rank, rank0_dir, rank0_host)
        problems: list[str | None] = [None] * world_size
        dist.all_gather_object(problems, problem)
        failed = [p for p in problems if p]
        if failed:
            raise RunFailure(failed[0] + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""))
        return cls(path, lock)

    def keep_tokenizer(self, fingerprint: str, sources: list[str | os.PathLike | None]) -> None:
        """Rank 0: a copy of the tokenizer of ``fingerprint`` (the first of this run's copy and ``sources`` that
        holds it) in ``{output_dir}/tokenizer``; a warning when none does."""
        target = self.path / "tokenizer"
        try:
            source = find_tokenizer_dir(fingerprint, [target, *sources])
        except TokenizerError as error:
            log.warning("no copy of the tokenizer kept with the run (exports will need --tokenizer): %s", error)
            return
        if source == target:
            return
        tokenizer = load_tokenizer(source)
        self.path.mkdir(parents=True, exist_ok=True)
        staging = make_temporary_directory(self.path, ".tokenizer.")
        for name in [*tokenizer.files, "tokenizer.json"]:
            shutil.copyfile(source / name, staging / name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _find_lock(path: Path, token: str, rank: int, rank0_dir: str, rank0_host: str) -> str | None:
    """None once ``path`` holds rank 0's lock of ``token``; what this rank found instead after
    `SHARED_DIRECTORY_WAIT_S`."""
    deadline = time.monotonic() + SHARED_DIRECTORY_WAIT_S
    while True:
        try:
            holder = read_holder(path)
        except (OSError, ValueError):
            holder = None
        if holder is not None and holder.token == token:
            return None
        if time.monotonic() > deadline:
            found = "finds no" if holder is None else "finds another run's"
            return (
                f"train.output_dir must be on a filesystem shared by all nodes: rank {rank} on "
                f"{socket.gethostname()} {found} {LOCK_NAME} in {path.parent.absolute()}, where rank 0 "
                f"on {rank0_host} wrote this run's in {rank0_dir}"
            )
        time.sleep(0.5)


def require_writable(output_dir: Path) -> None:
    """train.output_dir, or the folder it will be made in, accepts a new file (probed: permissions alone do not
    tell a read-only mount or a root-squashed NFS export)."""
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        target = dangling_link(existing)
        if target is not None:  # mkdir would fail on it with "File exists"
            raise ValueError(
                f"train.output_dir={str(output_dir)!r}: {existing} is a symbolic link to {target}, which leads "
                f"nowhere: create its target or remove the link"
            )
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"train.output_dir={str(output_dir)!r}: {existing} is a file, not a directory")
    # The folders the run writes into later (its checkpoints hours from now) are probed too, where they exist.
    written_later = [output_dir / name for name in (CHECKPOINTS, TENSORBOARD, PROFILE)]
    for folder in [existing, *(path for path in written_later if path.is_dir())]:
        try:
            handle, probe = tempfile.mkstemp(prefix=".txl_dist-write-probe.", dir=folder)
            os.close(handle)
            os.unlink(probe)
        except OSError as error:
            message = f"train.output_dir={str(output_dir)!r}: cannot write in {describe_os_error(error, folder)}"
            raise (ValueError if os_error_status(error) == USAGE_ERROR else CommandFailure)(message) from None
