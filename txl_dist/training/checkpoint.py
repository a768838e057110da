"""Training checkpoints: DeepSpeed's engine checkpoint plus what DeepSpeed does not know about.

A checkpoint is the folder ``{directory}/{tag}`` (tag ``step00001234``) holding

- DeepSpeed's files (module, ZeRO optimizer partitions, LR scheduler), with the run's client state inside: step,
  tokens seen, the data position, the resolved config, the best validation result so far;
- ``txl_rank_states/rank{r:05d}.pt`` per rank: the memory of every stream the rank owned (by global stream id)
  and the rank's random-number-generator states;
- ``COMPLETE.json``, written by rank 0 only after every rank has finished writing: the step, the architecture,
  and every file of the checkpoint with its size and CRC-32.

Every file is written under a temporary name, synced and renamed (DeepSpeed's too: its checkpoint engine is
wrapped), and its checksum is computed from the bytes as they are written, so a checkpoint costs no second read;
``COMPLETE.json`` therefore lists files that are on disk. ``{directory}/latest`` names the newest complete
checkpoint and is replaced atomically after ``COMPLETE.json``. (DeepSpeed's own ``latest`` is written by rank 0
without waiting for the other ranks' optimizer files, so it is turned off.) A folder without ``COMPLETE.json`` is a
save that was interrupted: it is never resumed from, and the next run removes it.

Verification: before a checkpoint is trusted (resume, evaluate, convert) each listed file must exist with its size
and CRC-32, and no other file may be there (DeepSpeed finds some files by pattern). Resume takes the newest
checkpoint that verifies -- the ranks share the reading -- and says which it skipped and why. Rotation keeps the
last ``keep_last`` checkpoints (all with 0) not known to be damaged, the best one by validation loss, and always
the newest verified one, so a damaged checkpoint never pushes the last good one out.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from txl_dist.fileio import (
    CHECKSUM_NAME,
    FileChecksum,
    atomic_write_checksummed,
    atomic_write_text,
    file_checksum,
)
from txl_dist.training import weights_only

log = logging.getLogger("txl_dist.training")

CLIENT_KEY = "txl_dist"
"""The key of our client state inside DeepSpeed's model-state file."""
LATEST = "latest"
COMPLETE = "COMPLETE.json"
RANK_STATES = "txl_rank_states"
FILES_KEY = "files"
"""The key of COMPLETE.json listing every file of the checkpoint: relative path -> {"bytes", "crc32"}."""
_TAG_RE = re.compile(r"step(\d{8})")


def refuse_fresh_start(directory: str | os.PathLike, newest: str) -> None:
    """checkpoint.resume=false where ``directory`` holds checkpoints (the newest is ``newest``): a fresh start
    would interleave its checkpoints with the old run's."""
    raise ValueError(
        f"checkpoint.resume=false, but {directory} holds checkpoints (newest {newest}): choose another "
        f"train.output_dir, or remove them"
    )


def refuse_another_architecture(
    directory: str | os.PathLike, tag: str, marker: dict[str, Any], architecture: dict[str, Any]
) -> None:
    """ValueError naming every key on which the architecture recorded in checkpoint ``tag``'s COMPLETE.json
    (``marker``) differs from ``architecture``. The command line checks the newest complete checkpoint before any
    process group starts; the trainer checks the one it resumes from after verifying it."""
    saved = marker.get("architecture")
    if not isinstance(saved, dict):
        raise CheckpointVerificationError(f"{Path(directory) / tag / COMPLETE}: no architecture recorded")
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, config {architecture.get(key)!r}"
        for key in sorted(set(saved) | set(architecture))
        if saved.get(key) != architecture.get(key)
    ]
    if differences:
        raise ValueError(f"{Path(directory) / tag} was trained with another architecture: " + "; ".join(differences))


def saved_zero_stages(tag_dir: str | os.PathLike, marker: dict[str, Any]) -> tuple[int, ...]:
    """The ZeRO stage(s) checkpoint ``tag_dir`` may have been written with: the one COMPLETE.json records, else
    (checkpoints written before it did) what DeepSpeed's file names tell: ZeRO-3 names its model-state files per
    rank; ZeRO 1 and 2 write optimizer files ``zero_pp_rank_*`` (``bf16_zero_pp_rank_*`` in bf16, as bf16 ZeRO-0
    does); fp32 ZeRO-0 writes none."""
    if isinstance(marker.get("zero_stage"), int):
        return (marker["zero_stage"],)
    tag_dir = Path(tag_dir)
    if any(tag_dir.glob("zero_pp_rank_*_model_states.pt")):
        return (3,)
    if any(tag_dir.glob("bf16_zero_pp_rank_*_optim_states.pt")):
        return (0, 1, 2)
    if any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):
        return (1, 2)
    return (0,)


def refuse_another_zero_stage(directory: str | os.PathLike, tag: str, marker: dict[str, Any], stage: int) -> None:
    """ValueError when checkpoint ``tag`` cannot be resumed at ZeRO ``stage``. DeepSpeed 0.19 loads a checkpoint
    only into the optimizer class that wrote it: ZeRO 1 and 2 share one (and their checkpoints load into each other
    exactly); ZeRO-0 and ZeRO-3 have their own, and its universal checkpoint, which re-partitions for another
    number of ranks, keeps the optimizer state in the layout of the stage that wrote it."""
    saved = saved_zero_stages(Path(directory) / tag, marker)
    family = {1: 1, 2: 1}
    if any(family.get(stage, stage) == family.get(s, s) for s in saved):
        return
    written = " or ".join(str(s) for s in saved) if len(saved) < 3 else "0, 1 or 2"
    raise ValueError(
        f"{Path(directory) / tag} was saved with ZeRO stage {written}, this run has zero.stage={stage}: "
        f"DeepSpeed cannot load a checkpoint into another stage's optimizer (only 1 and 2 load each "
        f"other's); resume with zero.stage={saved[-1]}, or take its weights without the optimizer state: "
        f"python launchers/convert.py zero-to-export {Path(directory) / tag} EXPORT"
    )


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


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


class CheckpointVerificationError(ValueError):
    """A checkpoint whose files do not match its COMPLETE.json; the message lists every problem found."""


def read_marker(tag_dir: str | os.PathLike) -> dict[str, Any]:
    """The COMPLETE.json of a checkpoint folder; a damaged one raises CheckpointVerificationError naming it."""
    path = Path(tag_dir) / COMPLETE
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointVerificationError(f"{path}: unreadable ({error})") from None
    if not isinstance(marker, dict):
        raise CheckpointVerificationError(f"{path}: not a completion marker (a JSON object)")
    return marker


def listed_files(tag_dir: str | os.PathLike, marker: dict[str, Any]) -> dict[str, FileChecksum]:
    """The files COMPLETE.json lists, by path relative to the checkpoint folder."""
    files = marker.get(FILES_KEY)
    if not isinstance(files, dict) or marker.get("checksum") != CHECKSUM_NAME:
        raise CheckpointVerificationError(
            f"{Path(tag_dir) / COMPLETE} lists no file checksums (a checkpoint written before txl_dist verified "
            f"its checkpoints): to trust it anyway, resume with checkpoint.verify=false or convert/evaluate with "
            f"--no-verify"
        )
    try:
        return {name: FileChecksum.from_json(entry) for name, entry in files.items()}
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointVerificationError(f"{Path(tag_dir) / COMPLETE}: malformed file list ({error})") from None


def _files_on_disk(tag_dir: Path) -> set[str]:
    return {
        path.relative_to(tag_dir).as_posix() for path in tag_dir.rglob("*") if path.is_file() and path.name != COMPLETE
    }


def check_files(
    tag_dir: str | os.PathLike, expected: dict[str, FileChecksum], threads: int = 1, marker: str = COMPLETE
) -> list[str]:
    """The problems of the given files (each names the file): missing, another size, another CRC-32. Sizes are
    all checked before any file is read, so a truncation is found at once. ``marker`` names the file that
    records the checksums (a checkpoint's COMPLETE.json, an export's checksums.json) in the messages."""
    tag_dir = Path(tag_dir)
    problems, to_read = [], []
    for name, want in sorted(expected.items()):
        path = tag_dir / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        except OSError as error:
            problems.append(f"{path}: unreadable ({error.strerror})")
            continue
        if size != want.bytes:
            problems.append(f"{path}: {size} bytes, {marker} records {want.bytes} (truncated or replaced)")
        else:
            to_read.append((name, want))

    def read(item: tuple[str, FileChecksum]) -> str | None:
        name, want = item
        try:
            got = file_checksum(tag_dir / name)
        except OSError as error:
            return f"{tag_dir / name}: unreadable ({error.strerror})"
        if got != want:
            return f"{tag_dir / name}: CRC-32 {got.crc32}, {marker} records {want.crc32} (damaged)"
        return None

    if threads > 1 and len(to_read) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:  # zlib.crc32 releases the GIL
            results = list(pool.map(read, to_read))
    else:
        results = [read(item) for item in to_read]
    return problems + [problem for problem in results if problem]


def check_listing(tag_dir: str | os.PathLike, marker: dict[str, Any], expected: dict[str, FileChecksum]) -> list[str]:
    """The problems that are not a file's bytes: files COMPLETE.json does not list, and a step that is not the
    folder's."""
    tag_dir = Path(tag_dir)
    problems = [
        f"{tag_dir / name}: not listed in {COMPLETE}" for name in sorted(_files_on_disk(tag_dir) - set(expected))
    ]
    match = _TAG_RE.fullmatch(tag_dir.name)
    if match and marker.get("step") != int(match.group(1)):
        problems.append(f"{tag_dir / COMPLETE}: records step {marker.get('step')}, the folder is {tag_dir.name}")
    return problems


def verify_checkpoint(tag_dir: str | os.PathLike, threads: int | None = None) -> list[str]:
    """Every problem of a checkpoint folder (an empty list: it verifies), read by one process with ``threads``
    threads (default: the CPUs)."""
    tag_dir = Path(tag_dir)
    try:
        marker = read_marker(tag_dir)
        expected = listed_files(tag_dir, marker)
    except CheckpointVerificationError as error:
        return [str(error)]
    threads = threads or min(8, os.cpu_count() or 1)
    return check_listing(tag_dir, marker, expected) + check_files(tag_dir, expected, threads)


class _RecordingCheckpointEngine:
    """DeepSpeed's checkpoint engine, but every file is written atomically (temporary name, fsync, rename) with
    its size and CRC-32 recorded as the bytes pass, and read weights-only (`txl_dist.training.weights_only`)."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.written: dict[str, FileChecksum] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        zip_format = getattr(self._inner, "zipfile_serialization", True)
        self.written[os.path.abspath(path)] = atomic_write_checksummed(
            path, lambda handle: torch.save(state_dict, handle, _use_new_zipfile_serialization=zip_format)
        )

    def load(self, path: str, map_location: Any = None) -> Any:
        return weights_only.load(path, map_location=map_location)


def _broadcast(value: Any) -> Any:
    """Rank 0's value on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _share(files: dict[str, FileChecksum], world_size: int) -> list[dict[str, FileChecksum]]:
    """The files dealt out to the ranks, largest first, each to the rank with the fewest bytes so far."""
    shares: list[dict[str, FileChecksum]] = [{} for _ in range(world_size)]
    loads = [0] * world_size
    for name, checksum in sorted(files.items(), key=lambda item: (-item[1].bytes, item[0])):
        rank = loads.index(min(loads))
        shares[rank][name] = checksum
        loads[rank] += checksum.bytes
    return shares


class CheckpointManager:
    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, keep_last: int):
        self.directory = Path(directory)
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.damaged: set[str] = set()
        """Checkpoints this run found damaged: never resumed, not counted by `keep_last`."""
        self.newest_verified: str | None = None
        """The newest checkpoint known good (verified at resume, or written by this run): never rotated away."""
        self._saving: str | None = None

    # ---- finding checkpoints -----------------------------------------------------------------------------------

    def complete_tags(self) -> list[str]:
        """Complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        tags = [p.name for p in self.directory.iterdir() if _TAG_RE.fullmatch(p.name) and (p / COMPLETE).is_file()]
        return sorted(tags)

    def latest_tag(self) -> str | None:
        """The checkpoint ``latest`` names if it is complete, else the newest complete one (no verification)."""
        latest = self.directory / LATEST
        if latest.is_file():
            tag = latest.read_text(encoding="utf-8").strip()
            if (self.directory / tag / COMPLETE).is_file():
                return tag
            log.warning(
                "%s names %s, which is not a complete checkpoint; looking for the newest complete one", latest, tag
            )
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

    def choose_resume_tag(self, verify: bool) -> str | None:
        """Collective: the newest complete checkpoint that verifies, chosen on rank 0 and known to every rank.

        The ranks share the reading of each candidate's files. Checkpoints that fail are skipped with a warning
        naming every problem and remembered in `damaged`; when none verifies the run stops rather than start
        afresh beside them. With ``verify`` False the newest complete checkpoint is taken as it is."""
        candidates = _broadcast(self.complete_tags()[::-1] if self.rank == 0 else None)
        if not candidates:
            return None
        if not verify:
            if self.rank == 0:
                log.warning(
                    "checkpoint.verify=false: resuming from %s without checking its files against %s",
                    self.directory / candidates[0],
                    COMPLETE,
                )
            return candidates[0]
        for tag in candidates:
            problems = self._verify_collectively(tag)
            if not problems:
                self.newest_verified = tag
                return tag
            self.damaged.add(tag)
            if self.rank == 0:
                log.warning(
                    "skipping checkpoint %s, which fails verification: %s", self.directory / tag, "; ".join(problems)
                )
        raise CheckpointVerificationError(
            f"none of the {len(candidates)} complete checkpoints in {self.directory} verifies (see the warnings "
            f"above): move them aside to start afresh, or resume with checkpoint.verify=false to trust one"
        )

    def _verify_collectively(self, tag: str) -> list[str]:
        tag_dir = self.directory / tag
        if self.rank == 0:
            try:
                marker = read_marker(tag_dir)
                expected = listed_files(tag_dir, marker)
                plan = (None, _share(expected, self.world_size))
                problems = check_listing(tag_dir, marker, expected)
            except CheckpointVerificationError as error:
                plan, problems = (str(error), None), []
        else:
            plan, problems = None, []
        failure, shares = _broadcast(plan)
        if failure is not None:
            return [failure]
        problems += check_files(tag_dir, shares[self.rank])
        gathered: list[list[str]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, problems)
        return [problem for rank_problems in gathered for problem in rank_problems]

    # ---- saving ------------------------------------------------------------------------------------------------

    def install(self, engine) -> None:
        """Route DeepSpeed's checkpoint files through `_RecordingCheckpointEngine` (call once, after initialize)."""
        if not isinstance(engine.checkpoint_engine, _RecordingCheckpointEngine):
            engine.checkpoint_engine = _RecordingCheckpointEngine(engine.checkpoint_engine)

    def save(
        self,
        engine,
        step: int,
        client_state: dict[str, Any],
        rank_state: RankState,
        architecture: dict[str, Any],
        best_tag: str | None = None,
    ) -> str:
        """Collective: every rank calls it at the same step. ``architecture`` goes into COMPLETE.json, where a
        resuming run checks it before building anything."""
        self.install(engine)
        recorder: _RecordingCheckpointEngine = engine.checkpoint_engine
        tag = tag_for_step(step)
        tag_dir = self.directory / tag
        self._saving = tag
        if self.rank == 0 and tag_dir.exists():
            # A folder of this name from an earlier attempt (an interrupted save, or a run that did not resume):
            # its files must not mix with this save's, nor can it stay marked complete meanwhile.
            shutil.rmtree(tag_dir)
        dist.barrier()
        recorder.written.clear()
        engine.save_checkpoint(str(self.directory), tag=tag, client_state=client_state, save_latest=False)
        states_dir = tag_dir / RANK_STATES
        states_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "stream_ids": torch.tensor(rank_state.stream_ids, dtype=torch.long),
            "mems": rank_state.mems,
            "rng": rank_state.rng,
            "world_size": rank_state.world_size,
            "rank": rank_state.rank,
        }
        state_path = states_dir / f"rank{self.rank:05d}.pt"
        written = {path: checksum for path, checksum in recorder.written.items()}
        written[os.path.abspath(state_path)] = atomic_write_checksummed(
            state_path, lambda handle: torch.save(state, handle)
        )
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
            for name in sorted(_files_on_disk(tag_dir) - set(files)):
                # Not written through the checkpoint engine (none today): read back to be listed all the same.
                log.info("checksumming %s, written outside DeepSpeed's checkpoint engine", tag_dir / name)
                files[name] = file_checksum(tag_dir / name)
            # Rank r owns streams [r * n, (r + 1) * n): a resuming rank opens only the files of its streams.
            marker = {
                "step": step,
                "world_size": self.world_size,
                "streams_per_rank": len(rank_state.stream_ids),
                "rank_states": sorted(p.name for p in states_dir.glob("rank*.pt")),
                "architecture": architecture,
                "zero_stage": engine.zero_optimization_stage(),
                "checksum": CHECKSUM_NAME,
                FILES_KEY: {name: files[name].to_json() for name in sorted(files)},
            }
            atomic_write_text(tag_dir / COMPLETE, json.dumps(marker, indent=1) + "\n")
            atomic_write_text(self.directory / LATEST, tag + "\n")
            # DeepSpeed writes this pointer when the run resumed through a universal checkpoint; ours is `latest`.
            (self.directory / "latest_universal").unlink(missing_ok=True)
        self._saving = None
        self.damaged.discard(tag)
        self.newest_verified = tag  # its checksums are those of the bytes written, and the files are synced
        if self.rank == 0:
            self._prune(keep={tag, best_tag} - {None})
        dist.barrier()
        return tag

    def remove_unfinished_save(self) -> None:
        """Rank 0, when the run fails: remove the folder of a save that did not complete (nothing partial stays)."""
        tag = self._saving
        if self.rank == 0 and tag is not None and not (self.directory / tag / COMPLETE).is_file():
            shutil.rmtree(self.directory / tag, ignore_errors=True)

    def _prune(self, keep: set[str]) -> None:
        if self.keep_last == 0:  # keep every checkpoint
            return
        # Damaged checkpoints are left where they are (for a look), but they neither count as one of the last
        # `keep_last` nor push a good one out.
        usable = [tag for tag in self.complete_tags() if tag not in self.damaged]
        keep = keep | set(usable[-self.keep_last :]) | {self.newest_verified} - {None}
        for tag in usable:
            if tag not in keep:
                shutil.rmtree(self.directory / tag, ignore_errors=True)

    # ---- loading -----------------------------------------------------------------------------------------------

    def marker(self, tag: str) -> dict[str, Any]:
        """The COMPLETE.json of a checkpoint: step, world_size, streams_per_rank, rank_states, architecture, files."""
        return read_marker(self.directory / tag)

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
            log.info(
                "converting %s (%d ranks) to DeepSpeed's universal format for %d ranks",
                self.directory / tag,
                self.saved_world_size(tag),
                self.world_size,
            )
            with weights_only.deepspeed_loads_weights_only():
                ds_to_universal.main(
                    argparse.Namespace(
                        input_folder=str(self.directory / tag),
                        output_folder=str(target),
                        num_extract_workers=1,
                        num_merge_workers=1,
                        keep_temp_folder=False,
                        strict=True,
                        inject_missing_state=True,
                    )
                )
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
            state = weights_only.load(path, map_location="cpu")
            if same_rank:
                rng = state["rng"]
            if state["mems"] is None:
                continue
            for column, stream_id in enumerate(state["stream_ids"].tolist()):
                if stream_id in wanted:
                    mems[stream_id] = [layer[:, column] for layer in state["mems"]]
        return mems, rng
