"""What stays in a run's checkpoint folder, on rank 0: `remove_unfinished` clears what a stopped run left before a
run starts, and `prune` rotates after each save. Rotation keeps the last ``keep_last`` checkpoints (all with 0)
not known to be damaged or sick, and whatever the caller must keep (the one just written, the best by validation
loss, the newest verified, the ones a numerical fault rolled back to), so a damaged or sick checkpoint never pushes
a good one out; a universal conversion goes with its checkpoint."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from txl_dist.checkpoint_paths import COMPLETE, complete_tags, unfinished_entries, universal_source, unknown_entries

log = logging.getLogger("txl_dist.training")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_unfinished(directory: Path) -> None:
    """Delete what a stopped run left unfinished in ``directory``: the folders of interrupted saves, universal
    conversions, temporaries (`unfinished_entries`); name what else lies in the folder and leave it."""
    for path in unfinished_entries(directory):
        if universal_source(path.name) is not None:
            why = "a universal conversion left by a stopped run (the next resume that needs one converts again)"
        elif path.name.startswith("."):
            why = "the temporary of a write that was stopped"
        else:
            why = f"an interrupted save (no {COMPLETE})" if path.is_dir() else "DeepSpeed's pointer, unused here"
        log.warning("removing %s: %s", path, why)
        _remove(path)
    for path in unknown_entries(directory):
        log.warning("%s was not written by txl_dist's checkpointing: left as it is, never read", path)


def prune(directory: Path, keep_last: int, keep: set[str], damaged: set[str], sick: set[str] = frozenset()) -> None:
    """Remove the complete checkpoints of ``directory`` beyond the last ``keep_last`` (0: keep every one) that are
    neither in ``keep`` nor ``damaged``, then the universal conversions whose checkpoint is gone. The ``sick`` ones
    (saved from a state whose loss was not finite) are rotated among themselves: the newest ``keep_last`` stay."""
    if keep_last == 0:
        return
    # Damaged checkpoints are left where they are (for a look), but they neither count as one of the last
    # `keep_last` nor push a good one out; nor do sick ones.
    tags = [tag for tag in complete_tags(directory) if tag not in damaged]
    healthy = [tag for tag in tags if tag not in sick]
    unhealthy = [tag for tag in tags if tag in sick]
    keep = keep | set(healthy[-keep_last:]) | set(unhealthy[-keep_last:])
    for tag in tags:
        if tag not in keep:
            shutil.rmtree(directory / tag, ignore_errors=True)
    remaining = set(complete_tags(directory))
    for path in directory.iterdir():
        if universal_source(path.name) not in (None, *remaining):  # its checkpoint is gone: nothing reads it
            log.warning("removing %s: the universal conversion of a checkpoint rotated away", path)
            shutil.rmtree(path, ignore_errors=True)
