"""Checking a training checkpoint, with no process group: its files against COMPLETE.json, and whether it may resume.

Before a checkpoint is trusted (resume, evaluate, convert) each file COMPLETE.json lists must exist with its size
and CRC-32, and no other file may be there (DeepSpeed finds some files by pattern). A resuming run also refuses a
checkpoint of another architecture, and a fresh start beside old checkpoints, before it builds anything
(another ZeRO stage or number of ranks is not refused: `txl_dist.checkpoints.universal`). Nothing here
writes, or needs a process group: the ranks' shared reading (`txl_dist.checkpoints.manager`) deals the files out
with `deal_files_to_ranks` and each rank checks its share with `check_files`.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from txl_dist.checkpoint_paths import COMPLETE, FILES_KEY, complete_tags, files_on_disk, step_of_tag
from txl_dist.fileio import CHECKSUM_NAME, FileChecksum, file_checksum, read_json


class CheckpointVerificationError(ValueError):
    """A checkpoint whose files do not match its COMPLETE.json; the message lists every problem found."""


def read_marker(tag_dir: str | os.PathLike) -> dict[str, Any]:
    """The COMPLETE.json of a checkpoint folder; a damaged one raises CheckpointVerificationError naming it."""
    path = Path(tag_dir) / COMPLETE
    marker = read_json(path, CheckpointVerificationError, "unreadable")
    if not isinstance(marker, dict):
        raise CheckpointVerificationError(f"{path}: not a completion marker (a JSON object)")
    for key, (allowed, what) in _MARKER_FIELDS.items():
        if key in marker and not allowed(marker[key]):
            raise CheckpointVerificationError(f"{path}: {key!r} is {marker[key]!r:.80}, not {what} (a damaged marker)")
    return marker


def whole_number(value: Any, least: int = 0, most: int | None = None) -> bool:
    """Whether a recorded value is a whole number (not a bool) from ``least`` to ``most``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
    return ok and (most is None or value <= most)


def finite_number(value: Any) -> bool:
    """Whether a recorded value is a finite number (not a bool): what a healthy step's loss or norm is."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_MARKER_FIELDS = {
    "step": (lambda v: whole_number(v, 0), "a step number"),
    "world_size": (lambda v: whole_number(v, 1), "a number of ranks"),
    "streams_per_rank": (lambda v: whole_number(v, 1), "a number of streams"),
    "architecture": (lambda v: isinstance(v, dict), "a mapping of the model's architecture"),
    "rank_states": (lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "a list of file names"),
    "health": (lambda v: isinstance(v, dict), "a mapping of the step's loss and gradient norm"),
}
"""The fields of COMPLETE.json that txl_dist reads, when present: a value of another type is a damaged marker,
refused by name before a reader trips over it."""


def health_problem(marker: dict[str, Any]) -> str | None:
    """Why a checkpoint's recorded state is sick (its step's loss or gradient norm, COMPLETE.json ``health``, was
    not finite: a run with numerics.check=false saved it so), None when it is healthy or records nothing. Such a
    checkpoint is never resumed, and rotation keeps the healthy ones for it."""
    health = marker.get("health") or {}
    if not isinstance(health, dict):
        return f"its recorded health {health!r:.40} is no mapping of its step's loss and gradient norm"
    for name, what in (("loss", "loss"), ("grad_norm", "gradient norm")):
        value = health.get(name)
        if value is not None and not finite_number(value):
            return f"its step's {what} was {value}"
    return None


def listed_files(tag_dir: str | os.PathLike, marker: dict[str, Any]) -> dict[str, FileChecksum]:
    """The files COMPLETE.json lists, by path relative to the checkpoint folder; CheckpointVerificationError naming
    the marker and what is wrong with it (no list at all, another checksum, a malformed entry)."""
    path = Path(tag_dir) / COMPLETE
    files, algorithm = marker.get(FILES_KEY), marker.get("checksum")
    trust_anyway = "to trust it anyway, resume with checkpoint.verify=false or convert/evaluate with --no-verify"
    if algorithm is None or files is None:
        raise CheckpointVerificationError(
            f"{path} lists no file checksums (a checkpoint written before txl_dist verified its checkpoints): "
            f"{trust_anyway}"
        )
    if algorithm != CHECKSUM_NAME:
        raise CheckpointVerificationError(
            f"{path}: checksum {algorithm!r} is not one that txl_dist checks (it records {CHECKSUM_NAME!r}): the "
            f"marker was written by another tool or damaged; {trust_anyway}"
        )
    if not isinstance(files, dict):
        raise CheckpointVerificationError(
            f"{path}: {FILES_KEY!r} is {type(files).__name__} {files!r:.60}, not a mapping of file names to their "
            f"sizes and checksums (a damaged marker)"
        )
    checksums = {}
    for name, entry in files.items():
        try:
            checksums[name] = FileChecksum.from_json(entry)
        except ValueError as error:
            raise CheckpointVerificationError(f"{path}: the entry of {name!r} is malformed: {error}") from None
    return checksums


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
        if os.path.isabs(name) or ".." in Path(name).parts:
            # A damaged or hand-edited record must not make verification read (or vouch for) a file elsewhere.
            problems.append(f"{tag_dir / marker}: lists {name!r}, which is not a file inside {tag_dir}")
            continue
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
        f"{tag_dir / name}: not listed in {COMPLETE}" for name in sorted(files_on_disk(tag_dir) - set(expected))
    ]
    step = step_of_tag(tag_dir.name)
    if step is not None and marker.get("step") != step:
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


def deal_files_to_ranks(files: dict[str, FileChecksum], world_size: int) -> list[dict[str, FileChecksum]]:
    """The files each rank reads in a shared verification: dealt out largest first, each to the rank with the
    fewest bytes so far."""
    shares: list[dict[str, FileChecksum]] = [{} for _ in range(world_size)]
    loads = [0] * world_size
    for name, checksum in sorted(files.items(), key=lambda item: (-item[1].bytes, item[0])):
        rank = loads.index(min(loads))
        shares[rank][name] = checksum
        loads[rank] += checksum.bytes
    return shares


def refuse_to_start(
    directory: str | os.PathLike,
    *,
    resume: bool,
    complete: list[str] = (),
    tag: str | None = None,
    marker: dict[str, Any] | None = None,
    architecture: dict[str, Any] | None = None,
) -> None:
    """The run-directory rules a start must pass, stated once: with ``resume`` False, no complete checkpoint may be
    in ``directory`` (``complete``, oldest first: a fresh start would interleave its checkpoints with the old run's);
    with ``resume``, checkpoint ``tag`` (COMPLETE.json ``marker``) must record this run's ``architecture``.
    ValueError naming the directory and what differs. Called twice on purpose: by `preflight` from the files alone,
    before any process group, and by `CheckpointManager.plan_resume` on the checkpoint it has verified."""
    if not resume:
        if complete:
            raise ValueError(
                f"checkpoint.resume=false, but {directory} holds checkpoints (newest {complete[-1]}): choose another "
                f"train.output_dir, or remove them"
            )
        return
    if tag is None or marker is None:
        return
    architecture = architecture or {}
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


def preflight(directory: str | os.PathLike, *, resume: bool, architecture: dict[str, Any]) -> None:
    """`refuse_to_start` on the newest complete checkpoint of ``directory`` whose recorded state is not sick
    (`health_problem`), from its COMPLETE.json alone (no process group, no reading of the weights), so that every
    rank stops with one line before the world forms. A damaged marker passes: the trainer's verification names what
    is wrong and falls back to an older checkpoint, which it checks with `refuse_to_start` in turn."""
    tags = complete_tags(directory)
    newest, marker = None, None
    for tag in reversed(tags if resume else []):
        try:
            found = read_marker(Path(directory) / tag)
        except CheckpointVerificationError:
            newest, marker = tag, None
            break
        if health_problem(found) is None:  # a sick one is never resumed: the one the resume takes is older
            newest, marker = tag, found
            break
    refuse_to_start(directory, resume=resume, complete=tags, tag=newest, marker=marker, architecture=architecture)


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
