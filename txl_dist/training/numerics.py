"""The run's own numbers watched: the health of every step, the spike detector, and what follows a fault
(docs/recovery.md, Numerical faults).

**The check.** Every step ends with the all-reduce the ranks already make (`txl_dist.training.trainer`,
``Trainer._agree``); it also carries each rank's loss of the step, the gradient norm and, in fp16, whether the loss
scaler skipped the step at its minimum scale, so that every rank holds the same `StepHealth` and reaches the same
verdict (`Watch.judge`) without a collective of its own. A step fails when its loss or gradient norm is not finite
(in fp16 an overflow is the scaler's ordinary work, which skips the update; a fault only when the scale is pinned at
precision.min_loss_scale), when its loss is above numerics.max_loss (three times worse than guessing uniformly, by
default: a diverged model, whatever its history), or when its loss is a spike (`SpikeDetector`). Steps whose
memories start empty (an epoch's first, the first after a skipped window) are neither judged as spikes nor kept in
the detector's window: their loss is higher by nature.

**After a fault** the trainer rolls back in the same process to the newest healthy state (the newest memory
snapshot, else the newest checkpoint that verifies) and asks `Recovery.plan`: the first rollback to that state for
a fault at that step replays the steps since it (a fault that does not come back was transient: `Recovery.passed`
says so at the failed step); the next one skips the data of those steps (`DataSkip`: every stream moves on exactly,
as on resume); past numerics.max_rollbacks_per_window, or numerics.max_rollbacks in all, the run stops with
`NumericalFailure` (exit status 4, which the Slurm batch script never retries), keeping the newest healthy
checkpoint.

**What the run keeps** (`NumericsState`, in every checkpoint's client state): the detector's window and the data
windows skipped. A skip the run has trained past, and the checkpoint it rolled back to for each fault (which
rotation then never removes), also go at once into ``numerics.json`` in the run folder (`NumericsRecord`), so that a
resume from a checkpoint older than a skip skips the same window, and the run stays reproducible.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from txl_dist.checkpoints.verify import finite_number, whole_number
from txl_dist.config import NumericsConfig
from txl_dist.exit_status import NUMERICAL_FAULT
from txl_dist.fileio import atomic_write_text, read_json
from txl_dist.supervision.guard import RunFailure

MIN_HISTORY = 10
"""Healthy steps the spike detector holds before it judges (fewer when numerics.spike_window is shorter)."""
ROBUST_DEVIATION = 1.4826
"""The median absolute deviation times this estimates a normal distribution's standard deviation."""
RECORD_FORMAT = "txl_dist.numerics"
RECORD_VERSION = 1


class NumericalFailure(RunFailure):
    """A fault the rollbacks did not cure: every rank raises it with the same one-line message (they agree on the
    verdict), and the run ends with `NUMERICAL_FAULT`."""

    exit_status = NUMERICAL_FAULT
    fault_kind = "numerics"
    found_by_every_rank = True

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step
        """The step that failed the check (what the fault log records)."""


def number_text(value: float | None) -> str:
    """A value for a one-line message: ``nan``, ``inf``, ``8.2133``."""
    if value is None:
        return "unknown"
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def json_number(value: float | None) -> float | str | None:
    """A float for a JSON file: non-finite values as the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


class StepHealth(NamedTuple):
    """One step's numbers, as the ranks agreed on them (the same on every rank)."""

    loss: float
    """The step's loss, the mean over the ranks."""
    grad_norm: float | None
    """The global gradient norm before clipping (None where the engine reports none)."""
    bad_ranks: int = 0
    """Ranks whose own loss was not finite."""
    bad_rank_sum: int = 0
    """The sum of those ranks' numbers (names the rank when there is one)."""
    overflow: bool = False
    """The engine found gradients that were not finite and skipped the update (fp16's loss scaler, or ZeRO's check
    in every precision)."""
    scale_pinned: bool = False
    """fp16: that overflow brought the loss scale down to precision.min_loss_scale (DeepSpeed's scaler ends the
    run at the next one)."""

    def record(self) -> dict[str, float | str | bool | None]:
        """The values a checkpoint records (COMPLETE.json ``health``, a snapshot's manifest). A step whose update
        the engine skipped left the weights and optimizer as they were: its numbers say nothing of the state saved,
        so none are recorded (``skipped_update``)."""
        if self.overflow:
            return {"loss": None, "grad_norm": None, "skipped_update": True}
        return {"loss": json_number(self.loss), "grad_norm": json_number(self.grad_norm)}


class Fault(NamedTuple):
    """A step that failed the check."""

    step: int
    check: str
    """What tripped: "loss", "grad_norm", "max_loss", "spike" or "loss_scale"."""
    text: str
    """What tripped, as a phrase: "the loss is nan on rank 1"."""
    loss: float
    grad_norm: float | None


class SpikeDetector:
    """A loss far above the recent ones: more than ``threshold`` robust deviations (1.4826 x the median absolute
    deviation) and ``min_rise`` x the median above the median of the last ``window`` healthy steps' losses."""

    def __init__(self, window: int, threshold: float, min_rise: float):
        self.window, self.threshold, self.min_rise = window, threshold, min_rise
        self.history: deque[float] = deque(maxlen=max(window, 1))

    def judge(self, loss: float) -> str | None:
        """Why ``loss`` is a spike, None when it is not (or the window holds too few steps to say)."""
        if not self.window or len(self.history) < min(self.window, MIN_HISTORY):
            return None
        median = statistics.median(self.history)
        deviation = ROBUST_DEVIATION * statistics.median(abs(value - median) for value in self.history)
        rise = loss - median
        if rise <= self.threshold * deviation or rise <= self.min_rise * abs(median):
            return None
        deviations = f"{rise / deviation:.1f} robust deviations" if deviation > 0 else "the window has no spread"
        return (
            f"the loss {number_text(loss)} is a spike, {number_text(rise)} above the median {number_text(median)} of "
            f"the last {len(self.history)} healthy steps ({deviations}; numerics.spike_threshold={self.threshold:g}, "
            f"spike_min_rise={self.min_rise:g})"
        )

    def add(self, loss: float) -> None:
        if self.window:
            self.history.append(loss)


@dataclass(frozen=True)
class DataSkip:
    """A data window skipped: at the data position ``data`` (reached at step ``at_step``), every stream moves on by
    ``steps`` steps, the data that steps ``at_step`` + 1 to ``failed_step`` trained on when it failed there."""

    at_step: int
    failed_step: int
    steps: int
    tokens: int
    """Tokens passed over, every stream's together."""
    data: dict[str, Any]
    """Where the streams stood (`data_key` of their state): epoch, step within it, position, streams, layout."""
    lr_factor: float = 1.0
    """The learning rate is multiplied by this once the window is skipped."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> str:
        """Where the window starts: one skip per data position, however many copies record it."""
        return json.dumps(self.data, sort_keys=True)

    @classmethod
    def from_json(cls, value: Any, where: str) -> DataSkip:
        """A skip as `to_json` wrote it; ValueError naming ``where`` and the field otherwise."""
        if not isinstance(value, dict):
            raise ValueError(f"{where}: a skipped window must be a mapping, got {type(value).__name__}")
        try:
            skip = cls(**value)
        except TypeError as error:
            raise ValueError(f"{where}: a skipped window has other fields ({error})") from None
        whole = {"at_step": 0, "failed_step": 1, "steps": 1, "tokens": 0}
        for name, least in whole.items():
            number = getattr(skip, name)
            if not whole_number(number, least):
                raise ValueError(f"{where}: a skipped window's {name!r} is {number!r}, not a whole number >= {least}")
        if not isinstance(skip.data, dict) or set(skip.data) != set(DATA_KEY_FIELDS):
            raise ValueError(f"{where}: a skipped window's 'data' must hold {', '.join(DATA_KEY_FIELDS)}")
        if not finite_number(skip.lr_factor) or not 0 < skip.lr_factor <= 1:
            raise ValueError(f"{where}: a skipped window's 'lr_factor' is {skip.lr_factor!r}, not a factor in (0, 1]")
        return skip


DATA_KEY_FIELDS = ("epoch", "step", "position", "num_streams", "layout")


def data_key(stream_state: dict[str, Any]) -> dict[str, Any]:
    """Where the training streams stand (`TrainStreams.state_dict`), as a skip names it: the epoch, the step within
    it, the position within the streams, their number and the sha256 of the spans they were cut from."""
    layout = json.dumps(stream_state["layout_spans"], separators=(",", ":"))
    return {
        "epoch": stream_state["epoch"],
        "step": stream_state["step"],
        "position": stream_state["position"],
        "num_streams": stream_state["num_streams"],
        "layout": hashlib.sha256(layout.encode("utf-8")).hexdigest()[:16],
    }


class NumericsState:
    """What a checkpoint keeps of the watch: the spike detector's window, the data windows skipped so far and the
    learning-rate factor they left."""

    def __init__(self, config: NumericsConfig):
        self.detector = SpikeDetector(config.spike_window, config.spike_threshold, config.spike_min_rise)
        self.skips: list[DataSkip] = []
        self.lr_factor = 1.0
        """The product of the learning-rate factors of the skips made so far (numerics.lr_factor_after_skip)."""

    def add_skips(self, skips: list[DataSkip]) -> None:
        """Skips known elsewhere (a checkpoint, the run's record), each once."""
        known = {skip.key() for skip in self.skips}
        for skip in skips:
            if skip.key() not in known:
                self.skips.append(skip)
                known.add(skip.key())

    def due(self, stream_state: dict[str, Any]) -> DataSkip | None:
        """The skip that starts where the streams stand now, if any."""
        key = data_key(stream_state)
        return next((skip for skip in self.skips if skip.data == key), None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.detector.history),
            "skips": [skip.to_json() for skip in self.skips],
            "lr_factor": self.lr_factor,
        }

    def load_state_dict(self, saved: Any, where: str) -> None:
        """The detector's window from a checkpoint (a checkpoint without one starts it empty), and its skips added
        to those known."""
        saved = saved if isinstance(saved, dict) else {}
        history = saved.get("history", [])
        self.detector.history.clear()
        for loss in history[-self.detector.history.maxlen :] if isinstance(history, list) else []:
            if finite_number(loss):
                self.detector.add(float(loss))
        self.add_skips([DataSkip.from_json(skip, where) for skip in saved.get("skips", [])])
        factor = saved.get("lr_factor", 1.0)
        self.lr_factor = float(factor) if finite_number(factor) and 0 < factor <= 1 else 1.0


@dataclass
class NumericsRecord:
    """``numerics.json`` in the run folder (`txl_dist.run_paths.NUMERICS`): the skips the run trained past and the
    checkpoints it rolled back to, which rotation keeps. Written by rank 0, atomically, whenever either grows."""

    path: Path
    skips: list[DataSkip] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Checkpoint tags to keep: the newest healthy checkpoint before each fault met."""

    @classmethod
    def read(cls, path: str | os.PathLike) -> NumericsRecord:
        """The run's record (empty when there is none); ValueError naming the file and what is wrong with it."""
        path = Path(path)
        if not path.exists():
            return cls(path)
        advice = ": move it aside to start without the data windows it skips"
        value = read_json(path, ValueError, "unreadable", advice, expect_object=True)
        if value.get("format") != RECORD_FORMAT or value.get("version") != RECORD_VERSION:
            raise ValueError(f"{path}: not a numerics record of version {RECORD_VERSION} ({RECORD_FORMAT}){advice}")
        skips, kept = value.get("skips", []), value.get("kept_checkpoints", [])
        if not isinstance(skips, list) or not isinstance(kept, list) or not all(isinstance(t, str) for t in kept):
            raise ValueError(f"{path}: 'skips' and 'kept_checkpoints' must be lists{advice}")
        return cls(path, [DataSkip.from_json(skip, str(path)) for skip in skips], list(kept))

    def write(self) -> None:
        record = {
            "format": RECORD_FORMAT,
            "version": RECORD_VERSION,
            "skips": [skip.to_json() for skip in self.skips],
            "kept_checkpoints": self.kept,
        }
        atomic_write_text(self.path, json.dumps(record, indent=1) + "\n")


def max_loss(config: NumericsConfig, n_token: int) -> float:
    """numerics.max_loss, or its default: 3 x ln(n_token)."""
    return config.max_loss if config.max_loss is not None else 3 * math.log(max(n_token, 2))


class Watch:
    """The verdict on each step (module docstring), from the agreed `StepHealth`; ``n_token``: the vocabulary's
    size, for the default numerics.max_loss."""

    def __init__(self, config: NumericsConfig, state: NumericsState, fp16: bool, n_token: int):
        self.config, self.state, self.fp16 = config, state, fp16
        self.max_loss = max_loss(config, n_token)

    def judge(self, step: int, health: StepHealth, memoryless: bool) -> Fault | None:
        """The fault of ``step``, None when it is healthy (or numerics.check is off); a healthy step's loss joins
        the detector's window unless its memories started empty (``memoryless``)."""
        if not self.config.check:
            return None
        fault = self._fault(step, health, memoryless)
        if fault is None and not memoryless and math.isfinite(health.loss):
            self.state.detector.add(health.loss)
        return fault

    def _fault(self, step: int, health: StepHealth, memoryless: bool) -> Fault | None:
        loss, norm = health.loss, health.grad_norm

        def fault(check: str, text: str) -> Fault:
            return Fault(step, check, text, loss, norm)

        if self.fp16 and health.overflow:
            if health.scale_pinned:
                return fault("loss_scale", "the fp16 loss scale is pinned at precision.min_loss_scale and overflows")
            return None  # the scaler skipped the update: its ordinary work
        if not math.isfinite(loss):
            where = f" on rank {health.bad_rank_sum}" if health.bad_ranks == 1 else f" on {health.bad_ranks} ranks"
            return fault("loss", f"the loss is {number_text(loss)}{where if health.bad_ranks else ''}")
        if norm is not None and not math.isfinite(norm):
            return fault("grad_norm", f"the gradient norm is {number_text(norm)}")
        if loss > self.max_loss:
            limit = "" if self.config.max_loss is not None else ", 3 x ln(n_token): worse than guessing uniformly"
            return fault(
                "max_loss", f"the loss {number_text(loss)} is above numerics.max_loss={self.max_loss:.4g}{limit}"
            )
        spike = None if memoryless else self.state.detector.judge(loss)
        return fault("spike", spike) if spike else None


class Plan(NamedTuple):
    """What to do after a rollback: "replay", "skip" or "stop"; ``why`` for a stop."""

    action: str
    attempt: int
    why: str = ""


@dataclass
class Incident:
    """A fault being answered: rolled back to ``restored``, for a fault at ``failed``, by ``action``."""

    restored: int
    failed: int
    action: str


class Recovery:
    """The rollbacks of this start of the run (module docstring): how many, to which state for which fault, and the
    incident waiting for its failed step to pass."""

    def __init__(self, config: NumericsConfig):
        self.config = config
        self.rollbacks = 0
        self.attempts: Counter[tuple[int, int]] = Counter()
        self.open: Incident | None = None

    def plan(self, fault: Fault, restored: int) -> Plan:
        """After restoring the state of step ``restored`` for ``fault``: replay, skip, or stop."""
        key = (restored, fault.step)
        self.attempts[key] += 1
        attempt = self.attempts[key]
        config = self.config
        if self.rollbacks >= config.max_rollbacks:
            return Plan("stop", attempt, f"numerics.max_rollbacks={config.max_rollbacks} rollbacks made")
        if attempt > config.max_rollbacks_per_window:
            tried = "a replay" + (f" and {attempt - 2} skip(s)" if attempt > 2 else "")
            return Plan(
                "stop",
                attempt,
                f"it came back after {tried} from step {restored} "
                f"(numerics.max_rollbacks_per_window={config.max_rollbacks_per_window})",
            )
        self.rollbacks += 1
        action = "replay" if attempt == 1 else "skip"
        self.open = Incident(restored, fault.step, action)
        return Plan(action, attempt)

    def passed(self, step: int) -> Incident | None:
        """The incident whose failed step ``step`` has now passed healthy, if any (closed)."""
        if self.open is None or step < self.open.failed:
            return None
        incident, self.open = self.open, None
        return incident
