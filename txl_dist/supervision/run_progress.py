"""How far a run got, read from its files alone (metrics.jsonl and the checkpoints' completion markers), and
what its command line says of it (train.output_dir, whether a world fits the global batch): the run's side of the
batch script's relaunch decision (`txl_dist.supervision.relaunch`). Reads YAML and JSON only, no torch.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from txl_dist.checkpoint_paths import complete_tags, step_of_tag
from txl_dist.config import load_config
from txl_dist.config.files import read_layers
from txl_dist.run_paths import METRICS, checkpoints_dir


class RunLogError(ValueError):
    """A line of metrics.jsonl that is not a train record this module can read; the message says why."""


def train_step(line: bytes) -> int | None:
    """The step of one metrics.jsonl line when it is a train record, None for another kind of record; RunLogError
    saying why for a line that is no record this module can read (not UTF-8 or JSON, not an object, a train record
    whose step is not a whole number)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunLogError("not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise RunLogError(f"not a JSON record ({error.msg})") from None
    if not isinstance(record, dict):
        raise RunLogError(f"a JSON {type(record).__name__}, not a record")
    if record.get("kind") != "train":
        return None
    step = record.get("step")
    if type(step) is not int or step < 0:
        raise RunLogError(f"a train record whose step is {step!r}, not a whole number")
    return step


def logged_step(path: Path, explain: Callable[[str], None]) -> int | None:
    """The newest step of the train records in metrics.jsonl at PATH (None without one). A line that is no record
    (the one a dying rank was writing, or a damaged one) is skipped: EXPLAIN names the file, the line and why, and the
    other lines and the checkpoints decide."""
    logged = None
    skipped: list[str] = []
    try:
        with open(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    step = train_step(line)
                except RunLogError as error:
                    skipped.append(f"line {number}: {error}")
                    continue
                if step is not None:
                    logged = max(logged or 0, step)
    except OSError:
        pass
    if skipped:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        explain(f"warning: {path}: skipped {len(skipped)} unreadable line(s) ({'; '.join(skipped[:3])}{more})")
    return logged


def run_progress(output_dir: Path, explain: Callable[[str], None] = lambda line: None) -> tuple[int | None, int | None]:
    """(the newest step reached, the newest checkpoint step with a completion marker) of a run. The step reached
    is the newest train record of metrics.jsonl or the newest checkpoint, whichever is later: a save on the clock
    (checkpoint.every_minutes) may come between two logged steps, and the log may be gone.

    The trainer verifies the checkpoint before it trusts it and falls back to an older one, so the second number
    is where the relaunch resumes when that checkpoint is whole, which it is unless the disk damaged it."""
    logged = logged_step(output_dir / METRICS, explain)
    checkpointed = None
    tags = complete_tags(checkpoints_dir(output_dir))
    if tags:
        checkpointed = step_of_tag(tags[-1])
    if checkpointed is not None:
        logged = max(logged or 0, checkpointed)
    return logged, checkpointed


def _config_args(train_args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The --config files and the key.path=value overrides among train.py's arguments."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    known, _ = parser.parse_known_intermixed_args(list(train_args))
    return known.config, [item for item in known.overrides if "=" in item]


def output_dir_of(train_args: Sequence[str]) -> Path | None:
    """train.output_dir as the ranks read it (the files and overrides merged; YAML alone, no imports of torch)."""
    data, _ = read_layers(*_config_args(train_args))
    train = data.get("train")
    output_dir = train.get("output_dir") if isinstance(train, dict) else None
    return Path(output_dir) if output_dir else None


def global_batch_fits(train_args: Sequence[str], old_world: int) -> Callable[[int], bool]:
    """Whether a world of N ranks fits the run's global batch (`TrainConfig.batch_split`, the one place of the
    rule). A world that divides OLD_WORLD always does (its accumulation is a multiple of the old one), so the full
    config is read only for the others."""
    cfg = None

    def fits(world: int) -> bool:
        nonlocal cfg
        if old_world % world == 0:
            return True
        if cfg is None:
            cfg = load_config(*_config_args(train_args))
        try:
            cfg.train.batch_split(world)
        except ValueError:
            return False
        return True

    return fits
