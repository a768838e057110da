"""Saving, choosing, pruning and converting training checkpoints: the operations every rank takes part in.

What a checkpoint holds and where (`txl_dist.checkpoint_paths`) and how its files are verified
(`txl_dist.checkpoints.verify`) are apart; this module writes and reads them under a process group.

Every file is written under a temporary name, synced and renamed (DeepSpeed's too: its checkpoint engine is
wrapped, `txl_dist.checkpoints.recording`), and its checksum is computed from the bytes as they are written, so a
checkpoint costs no second read; ``COMPLETE.json`` therefore lists files that are on disk. (DeepSpeed's own
``latest`` is written by rank 0 without waiting for the other ranks' optimizer files, so it is turned off.)

COMPLETE.json also records the health of the step it was saved at (its loss and gradient norm, as the ranks agreed
on them: `txl_dist.training.numerics`). Resume takes the newest checkpoint that verifies and whose recorded state is
not sick -- the ranks share the reading -- says which it skipped and why, and loads it under any ZeRO stage and
number of ranks (`txl_dist.checkpoints.universal`). Rotation (`txl_dist.checkpoints.rotation`) keeps the last
``keep_last`` checkpoints (all with 0) not known to be damaged or sick, the best one by validation loss, the ones a
numerical fault rolled back to (`keep`), and always the newest verified one, so a damaged or sick checkpoint never
pushes the last good one out.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from txl_dist.checkpoint_paths import (
    COMPLETE,
    FILES_KEY,
    LATEST,
    LATEST_UNIVERSAL,
    RANK_STATES,
    complete_tags,
    files_on_disk,
    is_complete,
    tag_for_step,
    universal_tag,
)
from txl_dist.checkpoints import rotation, weights_only
from txl_dist.checkpoints.background import BackgroundWrite, FileJob, host_copy
from txl_dist.checkpoints.rank_state import RankState, rank_state_job, read_rank_states, write_rank_state
from txl_dist.checkpoints.recording import RecordingCheckpointEngine
from txl_dist.checkpoints.resume_choice import ResumeChoice
from txl_dist.checkpoints.universal import LoadKind, ResumePlan, load_into_stage0, write_universal
from txl_dist.checkpoints.verify import (
    health_problem,
    read_marker,
)
from txl_dist.deepspeed_internals import universal_loading
from txl_dist.exit_status import CommandFailure
from txl_dist.fileio import CHECKSUM_NAME, FileChecksum, atomic_write_text, file_checksum

log = logging.getLogger("txl_dist.training")


@dataclass
class PendingSave:
    """A checkpoint whose files a thread is writing (checkpoint.background): what its COMPLETE.json will say."""

    tag: str
    step: int
    streams_per_rank: int
    architecture: dict[str, Any]
    zero_stage: int
    best_tag: str | None
    health: dict[str, Any] | None
    write: BackgroundWrite
    stall: float
    """Seconds training waited for this save: the host copy of every file."""


class CheckpointManager(ResumeChoice):
    """The checkpoints of one run's ``directory``, as rank ``rank`` of ``world_size`` takes part in them (which one
    a start or a rollback takes: `ResumeChoice`)."""

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, keep_last: int):
        self.directory = Path(directory)
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.damaged: set[str] = set()
        """Checkpoints this run found damaged: never resumed, not counted by `keep_last`, never removed."""
        self.sick: set[str] = set()
        """Checkpoints whose recorded state is sick (`health_problem`): never resumed, not counted by `keep_last`
        among the healthy ones; the newest ``keep_last`` of them stay for a look."""
        self.kept: set[str] = set()
        """Checkpoints rotation never removes: the healthy state a numerical fault rolled back to."""
        self.newest_verified: str | None = None
        """The newest checkpoint known good (verified at resume, or written by this run): never rotated away."""
        self._saving: str | None = None
        self.last_save_bytes = 0
        """Rank 0: the bytes of the last checkpoint this run wrote, every rank's files together."""
        self.pending: PendingSave | None = None
        """The save whose files are being written in the background, until it is complete."""
        self._complete_count = 0
        """The complete checkpoints the last `newest_good_tag` found, good or not."""

    # ---- finding checkpoints -----------------------------------------------------------------------------------

    def complete_tags(self) -> list[str]:
        """Complete checkpoints, oldest first."""
        return complete_tags(self.directory)

    def remove_incomplete(self) -> None:
        """Rank 0, before training (the run lock held): `rotation.remove_unfinished`."""
        if self.rank == 0:
            rotation.remove_unfinished(self.directory)

    # ---- saving ------------------------------------------------------------------------------------------------

    def install(self, engine) -> RecordingCheckpointEngine:
        """Route DeepSpeed's checkpoint files through `RecordingCheckpointEngine` (after initialize; once is
        enough, again is harmless); returns it."""
        return RecordingCheckpointEngine.install(engine)

    def save(
        self,
        engine,
        step: int,
        client_state: dict[str, Any],
        rank_state: RankState,
        architecture: dict[str, Any],
        best_tag: str | None = None,
        background: bool = False,
        health: dict[str, Any] | None = None,
    ) -> str:
        """Collective: every rank calls it at the same step. ``architecture`` goes into COMPLETE.json, where a
        resuming run checks it before building anything, and ``health`` (the step's loss and gradient norm), which
        resume and rotation read. With ``background``, the files are copied into host
        memory and written by a thread (`txl_dist.checkpoints.background`): the checkpoint is `pending` until
        `complete_pending`; a save in flight is finished first (at most one)."""
        self.finish_pending()
        recorder = self.install(engine)
        tag = tag_for_step(step)
        tag_dir = self.directory / tag
        self._saving = tag
        if self.rank == 0 and tag_dir.exists():
            # A folder of this name from an earlier attempt (an interrupted save, or a run that did not resume):
            # its files must not mix with this save's, nor can it stay marked complete meanwhile.
            shutil.rmtree(tag_dir)
        dist.barrier()
        recorder.written.clear()
        began = time.perf_counter()
        if background:
            recorder.deferred = []
            try:
                engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state, save_latest=False)
            finally:
                jobs, recorder.deferred = recorder.deferred, None
            jobs.append(rank_state_job(tag_dir, host_copy(rank_state, recorder.buffers, ("rank_state",))))
            self.pending = PendingSave(
                tag,
                step,
                len(rank_state.stream_ids),
                architecture,
                engine.zero_optimization_stage(),
                best_tag,
                health,
                BackgroundWrite(jobs).start(),
                stall=time.perf_counter() - began,
            )
            return tag
        engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state, save_latest=False)
        written = {**recorder.written, **write_rank_state(tag_dir, rank_state)}
        self._complete(
            tag,
            written,
            step=step,
            streams_per_rank=len(rank_state.stream_ids),
            architecture=architecture,
            zero_stage=engine.zero_optimization_stage(),
            best_tag=best_tag,
            health=health,
        )
        return tag

    def snapshot_jobs(
        self, engine, step: int, client_state: dict[str, Any], rank_state: RankState, scratch: Path
    ) -> tuple[list[FileJob], Path]:
        """Collective: the files that a checkpoint of STEP would hold for this rank, as jobs that serialise the
        live state (to run before training goes on), and the folder their paths are relative to. Nothing is
        written but DeepSpeed's empty folders and recovery scripts in SCRATCH."""
        recorder = self.install(engine)
        tag = tag_for_step(step)
        scratch.mkdir(parents=True, exist_ok=True)
        recorder.deferred, recorder.copy_deferred = [], False
        try:
            engine.save_checkpoint(str(scratch), tag=tag, client_state=client_state, save_latest=False)
        finally:
            jobs, recorder.deferred, recorder.copy_deferred = recorder.deferred, None, True
        tag_dir = scratch / tag
        shutil.rmtree(tag_dir, ignore_errors=True)
        return [*jobs, rank_state_job(tag_dir, rank_state)], tag_dir

    def mark_restored(self, tag_dir: Path, files: dict[str, FileChecksum], manifest: dict[str, Any]) -> None:
        """Rank 0: a checkpoint written back from memory snapshots (`txl_dist.checkpoints.snapshots.Snapshots.restore`),
        complete with the checksums of the bytes written and the facts of the snapshot's manifest."""
        self._mark_complete(
            tag_dir,
            files,
            step=manifest["step"],
            streams_per_rank=manifest["streams_per_rank"],
            architecture=manifest["architecture"],
            zero_stage=manifest["zero_stage"],
            world_size=manifest["world_size"],
            health=manifest.get("health"),
        )

    def writing(self) -> tuple[bool, bool]:
        """This rank's part of a background save: (its thread still writes, its thread failed)."""
        if self.pending is None:
            return False, False
        write = self.pending.write
        return write.running, not write.running and write.error is not None

    def complete_pending(self) -> PendingSave:
        """Collective, once every rank's write has ended (`writing` is False everywhere, as the ranks agreed):
        the pending checkpoint marked COMPLETE, or, when a rank's write failed, that rank's error (the others
        raise a one-line error that points at it)."""
        pending = self.pending
        assert pending is not None
        pending.write.wait()
        failures: list[str | None] = [None] * self.world_size
        mine = None if pending.write.error is None else f"{type(pending.write.error).__name__}"
        dist.all_gather_object(failures, mine)
        self.pending = None
        if pending.write.error is not None:
            raise pending.write.error
        failed = [rank for rank, failure in enumerate(failures) if failure is not None]
        if failed:
            raise CommandFailure(
                f"the background write of checkpoint {self.directory / pending.tag} failed on rank {failed[0]}"
            )
        self._complete(
            pending.tag,
            pending.write.written,
            step=pending.step,
            streams_per_rank=pending.streams_per_rank,
            architecture=pending.architecture,
            zero_stage=pending.zero_stage,
            best_tag=pending.best_tag,
            health=pending.health,
        )
        return pending

    def finish_pending(self) -> PendingSave | None:
        """Collective: wait for this rank's background write and complete the pending checkpoint (None when there
        was none): before another save, and at the end of the run."""
        if self.pending is None:
            return None
        return self.complete_pending()

    def _complete(
        self,
        tag: str,
        written: dict[str, FileChecksum],
        *,
        step: int,
        streams_per_rank: int,
        architecture: dict[str, Any],
        zero_stage: int,
        best_tag: str | None,
        health: dict[str, Any] | None,
    ) -> None:
        """Collective, once this rank's files are written (WRITTEN: their checksums by absolute path): rank 0
        marks the checkpoint complete when every rank's are, then rotates."""
        tag_dir = self.directory / tag
        mine = {
            Path(path).relative_to(tag_dir.absolute()).as_posix(): checksum
            for path, checksum in written.items()
            if Path(path).is_relative_to(tag_dir.absolute())
        }
        # Gathering the checksums is also the barrier: every rank has written before the checkpoint is complete.
        gathered: list[dict[str, FileChecksum]] | None = (
            [{} for _ in range(self.world_size)] if self.rank == 0 else None
        )
        dist.gather_object(mine, gathered, dst=0)
        if self.rank == 0:
            files: dict[str, FileChecksum] = {}
            for rank_files in gathered:
                files.update(rank_files)
            self.last_save_bytes = sum(checksum.bytes for checksum in files.values())
            self._mark_complete(
                tag_dir,
                files,
                step=step,
                streams_per_rank=streams_per_rank,
                architecture=architecture,
                zero_stage=zero_stage,
                health=health,
            )
        self._saving = None
        self.damaged.discard(tag)
        self.sick.discard(tag)  # a folder of this name from before (removed when this save began) is gone
        if health_problem({"health": health}) is not None:  # numerics.check=false: never resumed, never counted
            self.sick.add(tag)
        else:
            self.newest_verified = tag  # its checksums are those of the bytes written, and the files are synced
        if self.rank == 0:
            self._prune(keep={tag, best_tag} - {None})
        dist.barrier()

    def _mark_complete(
        self,
        tag_dir: Path,
        files: dict[str, FileChecksum],
        *,
        step: int,
        streams_per_rank: int,
        architecture: dict[str, Any],
        zero_stage: int,
        world_size: int | None = None,
        health: dict[str, Any] | None = None,
    ) -> None:
        """Rank 0, once every rank has written: COMPLETE.json listing ``files`` (and any file on disk written
        around the checkpoint engine), then ``latest``. WORLD_SIZE: the ranks that saved it (this run's)."""
        for name in sorted(files_on_disk(tag_dir) - set(files)):
            # Not written through the checkpoint engine (none today): read back to be listed all the same.
            log.info("checksumming %s, written outside DeepSpeed's checkpoint engine", tag_dir / name)
            files[name] = file_checksum(tag_dir / name)
        # Rank r owns streams [r * n, (r + 1) * n): a resuming rank opens only the files of its streams.
        marker = {
            "step": step,
            "world_size": self.world_size if world_size is None else world_size,
            "streams_per_rank": streams_per_rank,
            "rank_states": sorted(p.name for p in (tag_dir / RANK_STATES).glob("rank*.pt")),
            "architecture": architecture,
            "zero_stage": zero_stage,
            **({"health": health} if health is not None else {}),
            "checksum": CHECKSUM_NAME,
            FILES_KEY: {name: files[name].to_json() for name in sorted(files)},
        }
        atomic_write_text(tag_dir / COMPLETE, json.dumps(marker, indent=1) + "\n")
        atomic_write_text(self.directory / LATEST, tag_dir.name + "\n")
        # DeepSpeed writes this pointer when the run resumed through a universal checkpoint; ours is `latest`.
        (self.directory / LATEST_UNIVERSAL).unlink(missing_ok=True)

    def remove_unfinished_save(self) -> None:
        """Rank 0, when the run fails: remove the folder of a save that did not complete (nothing partial stays)."""
        tag = self._saving
        if self.rank == 0 and tag is not None and not is_complete(self.directory / tag):
            shutil.rmtree(self.directory / tag, ignore_errors=True)

    def _prune(self, keep: set[str]) -> None:
        rotation.prune(
            self.directory, self.keep_last, keep | self.kept | {self.newest_verified} - {None}, self.damaged, self.sick
        )

    # ---- loading -----------------------------------------------------------------------------------------------

    def marker(self, tag: str) -> dict[str, Any]:
        """The COMPLETE.json of a checkpoint: step, world_size, streams_per_rank, rank_states, architecture, files."""
        return read_marker(self.directory / tag)

    def load(self, engine, plan: ResumePlan) -> dict[str, Any] | None:
        """Collective: load ``plan``'s checkpoint into ``engine`` (through DeepSpeed's universal loader where the
        plan says so, as saved otherwise: the same engine may load both, at the start and at a rollback); returns
        DeepSpeed's client state. A converted copy is made by rank 0 beside the checkpoint and removed once every
        rank has loaded it."""
        if self.rank == 0:
            log.info("loading %s", plan.describe())
        if plan.load is LoadKind.AS_SAVED:
            with weights_only.deepspeed_loads_weights_only(), universal_loading(engine, False):
                return engine.load_checkpoint(str(self.directory), tag=plan.tag)[1]
        universal = universal_tag(plan.tag)
        if self.rank == 0:
            names = [name for name, _ in engine.module.named_parameters()]
            write_universal(plan, self.directory / plan.tag, self.directory / universal, names)
        dist.barrier()
        try:
            if plan.stage == 0:
                return load_into_stage0(engine, self.directory / universal)
            with weights_only.deepspeed_loads_weights_only(), universal_loading(engine, True):
                return engine.load_checkpoint(str(self.directory), tag=universal)[1]
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(self.directory / universal, ignore_errors=True)
                # DeepSpeed writes this pointer when it converts; ours is `latest`.
                (self.directory / LATEST_UNIVERSAL).unlink(missing_ok=True)

    def load_rank_states(self, tag: str, stream_ids: list[int]) -> tuple[dict[int, list[torch.Tensor]], dict | None]:
        """`read_rank_states` of checkpoint ``tag`` for this rank."""
        return read_rank_states(self.directory / tag, self.marker(tag), self.rank, self.world_size, stream_ids)
