"""Where a training checkpoint's files are: tag names, file paths, the ``latest`` pointer, the complete tags.

A checkpoint is the folder ``{directory}/{tag}`` (tag ``step00001234``) holding

- DeepSpeed's files (module, ZeRO optimizer partitions, LR scheduler), with the run's client state inside (under
  `CLIENT_KEY`): step, tokens seen, the data position, the resolved config, the best validation result so far;
- ``txl_rank_states/rank{r:05d}.pt`` per rank: the memory of every stream the rank owned (by global stream id)
  and the rank's random-number-generator states;
- ``COMPLETE.json``, written by rank 0 only after every rank has finished writing: the step, the architecture,
  and every file of the checkpoint with its size and CRC-32.

``{directory}/latest`` names the newest complete checkpoint and is replaced atomically after ``COMPLETE.json``.
A folder without ``COMPLETE.json`` is a save that was interrupted: it is never resumed from, and the next run
removes it, with whatever else a stopped run leaves unfinished (`unfinished_entries`: a universal conversion
``{tag}_universal``, the temporaries of atomic writes). Everything here reads names and paths only; nothing is
verified (`txl_dist.checkpoints.verify`) and no process group is needed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CLIENT_KEY = "txl_dist"
"""The key of our client state inside DeepSpeed's model-state file."""
LATEST = "latest"
COMPLETE = "COMPLETE.json"
RANK_STATES = "txl_rank_states"
FILES_KEY = "files"
"""The key of COMPLETE.json listing every file of the checkpoint: relative path -> {"bytes", "crc32"}."""
LATEST_UNIVERSAL = "latest_universal"
"""The pointer DeepSpeed writes when a run resumed through a universal checkpoint; ours is `LATEST`."""
_TAG_RE = re.compile(r"step(\d{8})")
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""The recovery scripts DeepSpeed's engine copies beside the checkpoints it saves."""
_UNIVERSAL_RE = re.compile(r"(step\d{8})_universal")
_TEMPORARY_RE = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")
"""The name of a file or folder that `txl_dist.fileio` writes beside its target and renames when it is whole."""


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def step_of_tag(name: str) -> int | None:
    """The step a checkpoint folder's name says, None for a name that is not a tag."""
    match = _TAG_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def universal_tag(tag: str) -> str:
    """The folder DeepSpeed's universal conversion of ``tag`` is written to."""
    return f"{tag}_universal"


def rank_state_path(tag_dir: str | os.PathLike, rank: int) -> Path:
    """The file of rank ``rank``'s stream memories and RNG states in a checkpoint folder."""
    return Path(tag_dir) / RANK_STATES / f"rank{rank:05d}.pt"


def is_complete(tag_dir: str | os.PathLike) -> bool:
    return (Path(tag_dir) / COMPLETE).is_file()


def complete_tags(directory: str | os.PathLike) -> list[str]:
    """The complete checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if step_of_tag(p.name) is not None and is_complete(p))


def interrupted_saves(directory: str | os.PathLike) -> list[Path]:
    """The checkpoint folders in ``directory`` without COMPLETE.json."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if step_of_tag(p.name) is not None and p.is_dir() and not is_complete(p)]


def universal_source(name: str) -> str | None:
    """The tag whose universal conversion a folder of this name is, None for any other name."""
    match = _UNIVERSAL_RE.fullmatch(name)
    return match.group(1) if match else None


def unfinished_entries(directory: str | os.PathLike) -> list[Path]:
    """What a run leaves in ``directory`` when it is stopped in the middle of writing, none of which any reader
    trusts: checkpoint folders without COMPLETE.json, universal conversions (they live only while a resume
    loads them), the temporaries of atomic writes and staging folders, and DeepSpeed's ``latest_universal``."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        [
            *interrupted_saves(directory),
            *(
                path
                for path in directory.iterdir()
                if universal_source(path.name) is not None
                or _TEMPORARY_RE.fullmatch(path.name)
                or path.name == LATEST_UNIVERSAL
            ),
        ]
    )


def unknown_entries(directory: str | os.PathLike) -> list[Path]:
    """What lies in ``directory`` that checkpointing neither wrote (complete checkpoints, ``latest``, DeepSpeed's
    scripts) nor leaves behind when stopped (`unfinished_entries`): a user's file, say, which is named and left
    alone."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    known = set(unfinished_entries(directory)) | {directory / tag for tag in complete_tags(directory)}
    known |= {directory / name for name in (LATEST, *DEEPSPEED_SCRIPTS)}
    return sorted(path for path in directory.iterdir() if path not in known)


def named_by_latest(directory: str | os.PathLike) -> str | None:
    """The tag ``{directory}/latest`` names (complete or not), None where there is no such file."""
    latest = Path(directory) / LATEST
    return latest.read_text(encoding="utf-8").strip() if latest.is_file() else None


def files_on_disk(tag_dir: str | os.PathLike) -> set[str]:
    """Every file of a checkpoint folder but COMPLETE.json, by path relative to the folder."""
    tag_dir = Path(tag_dir)
    return {
        path.relative_to(tag_dir).as_posix() for path in tag_dir.rglob("*") if path.is_file() and path.name != COMPLETE
    }


def model_state_files(tag_dir: str | os.PathLike) -> list[Path]:
    """DeepSpeed's model-state files (one, or one per rank under ZeRO-3), sorted."""
    return sorted(Path(tag_dir).glob("*model_states.pt"))


def has_optimizer_partitions(tag_dir: str | os.PathLike) -> bool:
    """Whether DeepSpeed wrote ZeRO optimizer partitions (a file per rank) in the folder."""
    return any(Path(tag_dir).glob("*optim_states.pt"))
