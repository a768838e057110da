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
from collections.abc import Callable
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
from txl_dist.checkpoints.record import CheckpointRecord
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
class Save:
    """One checkpoint being saved, until it is complete: the facts its COMPLETE.json will record, and the figures
    of the save that the trainer's log line gives."""

    tag: str
    record: CheckpointRecord
    best_tag: str | None
    """The best checkpoint by validation loss, which rotation keeps beside it."""
    write: BackgroundWrite | None = None
    """The thread writing its files (checkpoint.background); None for a save written before training goes on."""
    stall: float = 0.0
    """Seconds training waited for it: the whole save, or a background save's host copy of every file."""
    seconds: float = 0.0
    """Once complete: seconds its files took to write (a background save's, in its thread)."""
    bytes: int = 0
    """Once complete, on rank 0: its files' bytes, every rank's together."""
    waited: bool = False
    """A background save that the next save came to wait for."""

    @property
    def background(self) -> bool:
        return self.write is not None


class CheckpointManager(ResumeChoice):
    """The checkpoints of one run's ``directory``, as rank ``rank`` of ``world_size`` takes part in them (which one
    a start or a rollback takes: `ResumeChoice`)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        world_size: int,
        keep_last: int,
        on_complete: Callable[[Save], None] | None = None,
    ):
        self.directory = Path(directory)
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.on_complete = on_complete
        """Called on every rank with each save once it is complete (the trainer's log line)."""
        self.damaged: set[str] = set()
        """Checkpoints this run found damaged: never resumed, not counted by `keep_last`, never removed."""
        self.sick: set[str] = set()
        """Checkpoints whose recorded state is sick (`health_problem`): never resumed, not counted by `keep_last`
        among the healthy ones; the newest ``keep_last`` of them stay for a look."""
        self.kept: set[str] = set()
        """Checkpoints rotation never removes: the healthy state a numerical fault rolled back to."""
        self.newest_verified: str | None = None
        """The newest checkpoint known good (verified at resume, or written by this run): never rotated away."""
        self.pending: Save | None = None
        """The save whose files are being written in the background, until it is complete."""
        self._saving: str | None = None
        """The tag of this run's save in flight (written now or in the background), until it is complete."""
        self._complete_count = 0
        """The complete checkpoints the last `newest_good_tag` found, good or not."""

    # ---- finding checkpoints -----------------------------------------------------------------------------------

    def complete_tags(self) -> list[str]:
        """Complete checkpoints, oldest first."""
        return complete_tags(self.directory)

    def remove_unfinished(self) -> None:
        """Rank 0, before training (the run lock held): what a stopped run left, which no complete checkpoint
        owns (`rotation.remove_unfinished`)."""
        if self.rank == 0:
            rotation.remove_unfinished(self.directory)

    def abandon_save(self) -> None:
        """Rank 0, when this run fails: the folder of its own save in flight, unless it completed, so that nothing
        partial stays; nothing else in the folder is touched (another run may own it by then)."""
        tag = self._saving
        if self.rank == 0 and tag is not None and not is_complete(self.directory / tag):
            shutil.rmtree(self.directory / tag, ignore_errors=True)

    # ---- the save lifecycle: save, then poll at each step's agreement or finish ----------------------------------

    def install(self, engine) -> RecordingCheckpointEngine:
        """Route DeepSpeed's checkpoint files through `RecordingCheckpointEngine` (after initialize; once is
        enough, again is harmless); returns it."""
        return RecordingCheckpointEngine.install(engine)

    def save(
        self,
        engine,
        record: CheckpointRecord,
        client_state: dict[str, Any],
        rank_state: RankState,
        *,
        best_tag: str | None = None,
        background: bool = False,
        started: float | None = None,
    ) -> Save:
        """Collective: every rank calls it at the same step. ``record`` goes into COMPLETE.json, where a resuming
        run reads it before building anything. Written now, the save is complete when this returns; with
        ``background``, the files are copied into host memory and written by a thread
        (`txl_dist.checkpoints.background`), and the save stays `pending` until `poll` or `finish` completes it.
        A save in flight is finished first (at most one). ``started``: when training began to wait for this save
        (`time.perf_counter`; default now), from which its stall counts."""
        began = time.perf_counter() if started is None else started
        self.finish(waited=True)
        recorder = self.install(engine)
        save = Save(tag_for_step(record.step), record, best_tag)
        tag_dir = self.directory / save.tag
        self._saving = save.tag
        if self.rank == 0 and tag_dir.exists():
            # A folder of this name from an earlier attempt (an interrupted save, or a run that did not resume):
            # its files must not mix with this save's, nor can it stay marked complete meanwhile.
            shutil.rmtree(tag_dir)
        dist.barrier()
        recorder.written.clear()
        if background:
            recorder.deferred = []
            try:
                engine.save_checkpoint(str(self.directory), tag=save.tag, client_state=client_state, save_latest=False)
            finally:
                jobs, recorder.deferred = recorder.deferred, None
            jobs.append(rank_state_job(tag_dir, host_copy(rank_state, recorder.buffers, ("rank_state",))))
            save.write = BackgroundWrite(jobs).start()
            save.stall = time.perf_counter() - began
            self.pending = save
            return save
        engine.save_checkpoint(str(self.directory), tag=save.tag, client_state=client_state, save_latest=False)
        self._complete(save, {**recorder.written, **write_rank_state(tag_dir, rank_state)})
        save.stall = save.seconds = time.perf_counter() - began
        self._completed(save)
        return save

    def writing(self) -> bool:
        """Whether this rank's thread still writes the pending save: what each rank brings to the agreement that
        ends a step (`poll`)."""
        return self.pending is not None and self.pending.write.running

    def poll(self, writing_anywhere: bool) -> Save | None:
        """Collective, once the ranks agreed whether any rank's thread still writes the pending save (`writing`):
        when none does, the save completed, at the same step on every rank, and returned; else None."""
        if self.pending is None or writing_anywhere:
            return None
        return self._complete_pending(waited=False)

    def finish(self, waited: bool = False) -> Save | None:
        """Collective: wait for this rank's thread and complete the pending save (None when there was none):
        before another save (``waited``), a rollback, and the end of the run."""
        if self.pending is None:
            return None
        return self._complete_pending(waited)

    def _complete_pending(self, waited: bool) -> Save:
        """The pending save marked COMPLETE once every rank's write has ended, or, when a rank's write failed,
        that rank's error (the others raise a one-line error that points at it)."""
        save, self.pending = self.pending, None
        save.write.wait()
        failures: list[str | None] = [None] * self.world_size
        mine = None if save.write.error is None else f"{type(save.write.error).__name__}"
        dist.all_gather_object(failures, mine)
        if save.write.error is not None:
            raise save.write.error
        failed = [rank for rank, failure in enumerate(failures) if failure is not None]
        if failed:
            raise CommandFailure(
                f"the background write of checkpoint {self.directory / save.tag} failed on rank {failed[0]}"
            )
        self._complete(save, save.write.written)
        save.seconds, save.waited = save.write.seconds, waited
        self._completed(save)
        return save

    def _completed(self, save: Save) -> None:
        if self.on_complete is not None:
            self.on_complete(save)

    def _complete(self, save: Save, written: dict[str, FileChecksum]) -> None:
        """Collective, once this rank's files are written (WRITTEN: their checksums by absolute path): rank 0
        marks the checkpoint complete when every rank's are, then rotates."""
        tag_dir = self.directory / save.tag
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
            save.bytes = sum(checksum.bytes for checksum in files.values())
            self.mark_complete(tag_dir, files, save.record)
        self._saving = None
        self.damaged.discard(save.tag)
        self.sick.discard(save.tag)  # a folder of this name from before (removed when this save began) is gone
        if health_problem(save.record.fields()) is not None:  # numerics.check=false: never resumed, never counted
            self.sick.add(save.tag)
        else:
            self.newest_verified = save.tag  # its checksums are those of the bytes written, and the files are synced
        if self.rank == 0:
            self._prune(keep={save.tag, save.best_tag} - {None})
        dist.barrier()

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

    def mark_complete(self, tag_dir: Path, files: dict[str, FileChecksum], record: CheckpointRecord) -> None:
        """Rank 0, once every rank has written (a save of this run, or a checkpoint written back from memory
        snapshots: `txl_dist.checkpoints.snapshots.Snapshots.restore`): COMPLETE.json with ``record`` and
        ``files`` (and any file on disk written around the checkpoint engine), then ``latest``."""
        for name in sorted(files_on_disk(tag_dir) - set(files)):
            # Not written through the checkpoint engine (none today): read back to be listed all the same.
            log.info("checksumming %s, written outside DeepSpeed's checkpoint engine", tag_dir / name)
            files[name] = file_checksum(tag_dir / name)
        marker = {
            **record.fields(),
            "rank_states": sorted(p.name for p in (tag_dir / RANK_STATES).glob("rank*.pt")),
            "checksum": CHECKSUM_NAME,
            FILES_KEY: {name: files[name].to_json() for name in sorted(files)},
        }
        atomic_write_text(tag_dir / COMPLETE, json.dumps(marker, indent=1) + "\n")
        atomic_write_text(self.directory / LATEST, tag_dir.name + "\n")
        # DeepSpeed writes this pointer when the run resumed through a universal checkpoint; ours is `latest`.
        (self.directory / LATEST_UNIVERSAL).unlink(missing_ok=True)

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
