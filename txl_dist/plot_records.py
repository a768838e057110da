"""What `python -m txl_dist.plot` reads of a run: its ``metrics.jsonl`` records, each checked before it is drawn, as
the curves of its training and evaluation, the places of its steps on each x axis, and its numerical faults (the
steps rolled back, the data windows skipped). A malformed record is left out and named (`Run.skipped`); a file that
gives nothing to draw is a `PlotError`.
"""

from __future__ import annotations

import json
import math
import stat
from dataclasses import dataclass, field
from pathlib import Path

from txl_dist.fileio import describe_os_error
from txl_dist.run_paths import METRICS

THROUGHPUT = ("tokens_per_s", "mfu", "tflops")
"""The training records' throughput figures that the bottom row draws."""


class PlotError(ValueError):
    """A run or an argument that cannot be drawn (one line)."""


@dataclass
class Curve:
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Run:
    """One run's curves: ``train`` and ``eval`` hold loss/ppl/bpc by step; ``x`` maps a step to each axis."""

    name: str
    train: Curve
    eval: Curve
    x: dict[str, dict[int, float]]
    hparams: dict
    character_level: bool
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """The malformed records of metrics.jsonl that were left out: (line number, what is wrong)."""
    rollbacks: list[int] = field(default_factory=list)
    """The steps that failed the numerics check and were rolled back."""
    skipped_windows: list[tuple[int, int]] = field(default_factory=list)
    """The data windows skipped after a fault: (first step, last step) whose data was passed over."""

    def x_at(self, axis: str, step: int) -> float:
        """Where ``step`` lies on ``axis``: the place of the first logged step at or after it (NaN: none)."""
        logged = self.x[axis]
        following = [s for s in logged if s >= step]
        return logged[min(following)] if following else math.nan

    def label(self) -> str:
        h = self.hparams
        if not h:
            return self.name
        lr = h.get("optim.lr")
        settings = [
            f"{h.get('model.n_layer')} layers x d_model {h.get('model.d_model')}",
            f"mem_len {h.get('model.mem_len')}",
            f"lr {lr:.3g}" if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None,
            f"batch {h.get('train.global_batch')}",
            None if h.get("precision.dtype") is None else str(h["precision.dtype"]),
            f"ZeRO-{h.get('zero.stage')}",
            f"{h.get('world_size')} ranks",
        ]
        return f"{self.name}: " + ", ".join(s for s in settings if s)

    def skipped_warning(self) -> str | None:
        """One line for the records left out, naming the file, their count and the first one; None for none."""
        if not self.skipped:
            return None
        line, problem = self.skipped[0]
        return (
            f"{Path(self.name) / METRICS}: {len(self.skipped)} malformed record(s) left out of the plot, the first "
            f"on line {line} ({problem})"
        )


CURVE_VALUES = ("loss", "ppl", "bpc")
"""A record's values drawn as curves: numbers, where NaN or infinity (a diverged step, as the trainer logs it) is
a gap in the curve."""
AXIS_VALUES = ("tokens", "wall_time", "step_time_s")
"""A record's values that place its step on the x axes: finite numbers, at least 0. The training records'
`THROUGHPUT` figures are numbers too (``mfu`` may be null: no peak known); NaN or infinity is a gap."""
SCALARS = (str, int, float, bool, type(None))


MAX_STEP = 2**53
"""Steps are whole numbers below 2^53, which a float (an axis) holds exactly."""


def _is_number(value) -> bool:
    """An int or float (not a bool) that a float can hold: JSON's integers have no bound."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _record_problem(record) -> str | None:
    """What makes a decoded metrics.jsonl line unusable for the plot (the types of every field it reads), or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    kind, step = record.get("kind"), record.get("step")
    if not isinstance(kind, str):
        return f"'kind' is {kind!r}, not a string"
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
        return f"'step' is {step!r}, not a whole number >= 0 (and below 2^53)"
    drawn = (*CURVE_VALUES, *AXIS_VALUES, *(THROUGHPUT if kind == "train" else ()))
    for name in drawn if kind in ("train", "eval") else AXIS_VALUES:
        value = record.get(name)
        if name in THROUGHPUT and value is None:  # mfu is null where no peak is known
            continue
        if name in record and not _is_number(value):
            return f"'{name}' is {value!r}, not a number"
        if name in AXIS_VALUES and name in record and not (math.isfinite(value) and value >= 0):
            return f"'{name}' is {value!r}, not a finite number >= 0"
    if kind == "numerics":
        event = record.get("event")
        if not isinstance(event, str):
            return f"'event' is {event!r}, not a string"
        for name in ("from_step", "to_step") if event == "skip" else ():
            value = record.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_STEP:
                return f"'{name}' is {value!r}, not a whole number >= 0 (and below 2^53)"
    hparams = record.get("hparams", {})
    if kind == "start" and not (isinstance(hparams, dict) and all(isinstance(v, SCALARS) for v in hparams.values())):
        return "'hparams' is not a mapping of names to numbers or strings"
    return None


def _records(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """The usable records of a metrics.jsonl, and the malformed ones left out (line number, what is wrong). The
    last line cut short by a kill (no line end) is no record at all, and is left out without a word."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would be read forever, a device without end
            raise PlotError(f"{path}: not a regular file (not a metrics.jsonl written by launchers/train.py)")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file (not a run directory of launchers/train.py?)") from None
    except UnicodeDecodeError:
        raise PlotError(f"{path}: not UTF-8 text (not a metrics.jsonl written by launchers/train.py)") from None
    except OSError as error:
        raise PlotError(describe_os_error(error, path)) from None
    lines = text.splitlines()
    records, skipped = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines) or text.endswith("\n"):
                skipped.append((number, "not a JSON record"))
            continue
        problem = _record_problem(record)
        if problem is None:
            records.append(record)
        else:
            skipped.append((number, problem))
    return records, skipped


def _number(value) -> float:
    """A logged value as a float; NaN (a gap in the curve) for one that is missing or not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _training_time(records: list[dict], train: dict[int, dict]) -> dict[int, float]:
    """Seconds of training up to each step: the time within each start, without the gaps between starts."""
    if not all(math.isfinite(_number(r.get("wall_time"))) for r in records):  # older runs: the logged step times
        if not any(math.isfinite(_number(r.get("step_time_s"))) for r in train.values()):
            return {}  # no time logged at all: the time axis has no values
        elapsed, previous, seconds = {}, 0, 0.0
        for step in sorted(train):
            step_time = _number(train[step].get("step_time_s"))
            seconds += (step_time if math.isfinite(step_time) else 0.0) * (step - previous)
            elapsed[step], previous = seconds, step
        return elapsed
    elapsed, origin, offset, last = {}, None, 0.0, 0.0
    for record in records:
        if record["kind"] == "start" or origin is None:
            origin, offset = record["wall_time"], last
        last = offset + record["wall_time"] - origin
        if record["kind"] != "start":
            elapsed.setdefault(record["step"], last)  # a step's training record comes before its evaluation
    return elapsed


def read_run(directory: str | Path) -> Run:
    """A run's curves from its metrics.jsonl (the last record of a kind at a step wins, so a run resumed over
    steps it had logged before reads as one value per step); PlotError when there is nothing to draw."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "a file, not a run directory" if directory.exists() else "no such run directory"
        raise PlotError(f"{directory}: {what}")
    records, skipped = _records(directory / METRICS)
    by_kind: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    hparams: dict = {}
    rollbacks, windows = [], []
    for record in records:
        if record["kind"] in by_kind:
            by_kind[record["kind"]][record["step"]] = record
        elif record["kind"] == "start" and "hparams" in record:
            hparams = record["hparams"]
        elif record["kind"] == "numerics" and record["event"] == "rollback":
            rollbacks.append(record["step"])
        elif record["kind"] == "numerics" and record["event"] == "skip":
            windows.append((record["from_step"], record["to_step"]))
    train, evals = by_kind["train"], by_kind["eval"]
    if not train:
        left_out = (
            f" ({len(skipped)} malformed record(s) left out, the first on line {skipped[0][0]})" if skipped else ""
        )
        raise PlotError(f"{directory / METRICS}: no training step logged yet{left_out}")
    character_level = all("bpc" in r for r in train.values())
    # From the last training record that logged its tokens (none: the tokens axis has no values)
    counted = [r for r in train.values() if math.isfinite(_number(r.get("tokens")))]
    last = max(counted, key=lambda r: r["step"]) if counted else {"step": 1}
    tokens_per_step = _number(last.get("tokens")) / max(last["step"], 1)
    steps = sorted(set(train) | set(evals))
    elapsed = _training_time(records, train)
    x = {
        "step": {s: float(s) for s in steps},
        "tokens": {s: s * tokens_per_step for s in steps},
        "time": {s: elapsed.get(s, math.nan) for s in steps},
    }

    def curve(chosen: dict[int, dict]) -> Curve:
        result = Curve(sorted(chosen))
        for name in ("loss", "ppl", "bpc", *THROUGHPUT):
            result.values[name] = [_number(chosen[s].get(name)) for s in result.steps]
        return result

    run = Run(str(directory), curve(train), curve(evals), x, hparams, character_level, skipped)
    run.rollbacks, run.skipped_windows = sorted(set(rollbacks)), sorted(set(windows))
    return run
