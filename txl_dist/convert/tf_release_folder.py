"""A release folder of the authors' TensorFlow models, as their ``tf/sota/download.sh`` lays it out (see
`txl_dist.convert.tf_release`), and what it says besides the variables: which checkpoint, ``corpus-info.json``,
and the settings of their scripts that no checkpoint holds (`RELEASE_SETTINGS`). No TensorFlow here.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RELEASE_SETTINGS: dict[str, dict[str, Any]] = {
    # tf/sota/<dataset>.sh (TEST_TGT_LEN, TEST_MEM_LEN, TEST_CLAMP_LEN, --same_length=True) and the dropout of
    # tf/scripts/<dataset>_large_tpu.sh, which trained the released models.
    "wt103": dict(tgt_len=128, mem_len=1600, clamp_len=1000, same_length=True, dropout=0.2, dropatt=0.2),
    "lm1b": dict(tgt_len=32, mem_len=128, clamp_len=-1, same_length=True, dropout=0.05, dropatt=0.05),
    "enwik8": dict(tgt_len=128, mem_len=3800, clamp_len=1000, same_length=True, dropout=0.15, dropatt=0.15),
    "text8": dict(tgt_len=128, mem_len=3800, clamp_len=1000, same_length=True, dropout=0.15, dropatt=0.15),
}
"""The settings of the four released models that their checkpoints do not hold."""

SETTING_NAMES = ("tgt_len", "mem_len", "clamp_len", "same_length", "dropout", "dropatt")


class ReleaseError(ValueError):
    """A release folder or checkpoint this conversion cannot read; the message names the file or variable."""


@dataclass
class Release:
    """A release folder, located: its checkpoint prefix and data files."""

    root: Path
    prefix: Path
    cache: Path
    corpus_info: Path


def locate(root: str | os.PathLike, checkpoint: str | None = None) -> Release:
    """Find the checkpoint and the data of a release folder (see the module docstring); ``checkpoint`` names one
    prefix (``model.ckpt-0``) where ``model/`` holds several."""
    root = Path(root)
    if not root.is_dir():
        raise ReleaseError(
            f"{root}: no such folder (expected the folder download.sh made, e.g. pretrained_xl/tf_wt103)"
        )
    model_dir, data_dir = root / "model", root / "data"
    for folder in (model_dir, data_dir):
        if not folder.is_dir():
            raise ReleaseError(f"{folder}: missing; a release folder holds model/ and data/ (their download.sh)")
    indexes = sorted(p.name[: -len(".index")] for p in model_dir.glob("*.index"))
    if checkpoint is not None:
        name = Path(checkpoint).name
        if name not in indexes:
            raise ReleaseError(f"{model_dir}: no checkpoint {name!r} (it holds {indexes or 'none'})")
    elif len(indexes) == 1:
        name = indexes[0]
    elif not indexes:
        raise ReleaseError(f"{model_dir}: no TensorFlow checkpoint (no *.index file)")
    else:
        name = _recorded_checkpoint(model_dir, indexes)
    prefix = model_dir / name
    if not list(model_dir.glob(f"{name}.data-*")):
        raise ReleaseError(f"{prefix}.data-00000-of-00001: missing (the checkpoint's values; only its index is there)")
    release = Release(root, prefix, data_dir / "cache.pkl", data_dir / "corpus-info.json")
    for path in (release.cache, release.corpus_info):
        if not path.is_file():
            raise ReleaseError(f"{path}: missing (download.sh fetches it with the model)")
    return release


def _recorded_checkpoint(model_dir: Path, indexes: list[str]) -> str:
    """The checkpoint TensorFlow's ``checkpoint`` file names, by its base name (the file may hold the authors'
    own absolute paths)."""
    record = model_dir / "checkpoint"
    text = record.read_text(encoding="utf-8", errors="replace") if record.is_file() else ""
    found = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', text, re.MULTILINE)
    name = Path(found.group(1)).name if found else None
    if name not in indexes:
        raise ReleaseError(f"{model_dir}: holds the checkpoints {indexes}; choose one with --checkpoint")
    return name


def read_corpus_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ReleaseError(f"{path}: not readable JSON ({error})") from error
    if not isinstance(info, dict):
        raise ReleaseError(f"{path}: expected a JSON object, got {type(info).__name__}")
    size, cutoffs = info.get("vocab_size"), info.get("cutoffs")
    if not isinstance(size, int) or size < 1:
        raise ReleaseError(f"{path}: key 'vocab_size' must be a positive integer, got {size!r}")
    if not isinstance(cutoffs, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in cutoffs):
        raise ReleaseError(f"{path}: key 'cutoffs' must be a list of integers, got {cutoffs!r}")
    if cutoffs and (cutoffs[0] != 0 or cutoffs[-1] != size or cutoffs != sorted(set(cutoffs))):
        raise ReleaseError(f"{path}: key 'cutoffs' must rise from 0 to vocab_size {size}, got {cutoffs}")
    return info
