"""What a run reports, from rank 0 only: console lines, ``metrics.jsonl`` and TensorBoard (scalars, the Text
tab's run information at every start, the HParams dashboard's session).

Every other rank gets the same object with ``enabled=False``, so call sites need no rank checks. On resume the
records after the resumed step (written before an interruption, then lost with it) are dropped from
``metrics.jsonl`` and TensorBoard (a purge from the next step on), so both read as one uninterrupted run: one
value per step.

Logging never stops training: a sink that fails (its folder removed or replaced mid-run, a full disk, an
unwritable file) is dropped with one warning line naming its path and the cause, and the run goes on with the
others (the console always).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from txl_dist.fileio import atomic_write_text, describe_os_error
from txl_dist.run_layout import METRICS, TENSORBOARD
from txl_dist.training.run_files import file_identity, require_same_file
from txl_dist.training.tensorboard_events import EventFile

log = logging.getLogger("txl_dist.training")


class _MetricsFile:
    """``metrics.jsonl``: one JSON object a line, ``{"step", "kind", "wall_time", ...}``."""

    name = METRICS

    def __init__(self, path: Path, resume_step: int):
        self.path = path
        self.earlier_starts = _truncate_after(path, resume_step)
        self._file = open(path, "a", encoding="utf-8")
        self._identity = file_identity(self._file)

    def line(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        # Lines written to a file that was removed (or replaced) would be lost without a word.
        require_same_file(self.path, self._identity)

    def close(self) -> None:
        self._file.close()


def _truncate_after(path: Path, step: int) -> int:
    """Drop the records after ``step`` (rewritten atomically); return the "start" records kept."""
    if not path.is_file():
        return 0
    kept, starts = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line)
            starts += record.get("kind") == "start"
    atomic_write_text(path, "".join(line + "\n" for line in kept))
    return starts


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


class RunLogger:
    """The run's one logging helper (rank 0 writes, other ranks hold a disabled one)."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.earlier_starts = 0
        """Starts of this run before this one, as ``metrics.jsonl`` records them (its "start" lines)."""
        self._metrics: _MetricsFile | None = None
        self._events = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = self._open(METRICS, lambda: _MetricsFile(self.output_dir / METRICS, resume_step))
        if self._metrics is not None:
            self.earlier_starts = self._metrics.earlier_starts
        if tensorboard:
            # From the step after the resumed one, always: a run restarted from step 0 (killed before its first
            # checkpoint) would otherwise show the lost steps twice.
            self._events = self._open(
                TENSORBOARD, lambda: EventFile(self.output_dir / TENSORBOARD, purge_step=resume_step + 1)
            )

    def _open(self, name: str, opener):
        try:
            return opener()
        except Exception as error:  # noqa: BLE001 -- a logger never stops the run
            self._warn(name, self.output_dir / name, error, "at the start")
            return None

    def _warn(self, name: str, path: Path, error: BaseException, when: str) -> None:
        if isinstance(error, OSError) and error.errno is not None:
            cause = describe_os_error(error, error.filename or path)
        else:
            cause = str(error) if str(path) in str(error) else f"{path}: {type(error).__name__}: {error}"
        log.warning("logging: %s failed %s (%s); training goes on without it", name, when, cause)

    def _guarded(self, sink_attribute: str, step: int | None, action) -> None:
        """``action(sink)`` on one sink; the first failure drops that sink with one warning."""
        sink = getattr(self, sink_attribute)
        if sink is None:
            return
        try:
            action(sink)
        except Exception as error:  # noqa: BLE001 -- a logger never stops the run
            setattr(self, sink_attribute, None)
            where = f"at step {step}" if step is not None else "at the end"
            self._warn(sink.name, sink.path, error, where)
            try:
                sink.close()
            except Exception:  # noqa: BLE001 -- already reported; the handle is all that is left
                pass

    def info(self, message: str, *args: Any) -> None:
        if self.enabled:
            log.info(message, *args)

    def record(
        self, step: int, kind: str, values: dict[str, float | int | None], keep_null: Sequence[str] = ()
    ) -> None:
        """One metrics.jsonl line ``{"step", "kind", "wall_time", ...values}`` and TensorBoard scalars
        ``{kind}/{name}`` of the finite numbers. A None value is left out of the line, except those named in
        ``keep_null``, written as null (a figure the run cannot know, as opposed to one that does not apply)."""
        if not self.enabled:
            return
        clean = {k: v for k, v in values.items() if v is not None or k in keep_null}
        line = {"step": step, "kind": kind, "wall_time": time.time(), **clean}
        self._guarded("_metrics", step, lambda metrics: metrics.line(line))

        def scalars(events) -> None:
            events.scalars(step, {f"{kind}/{name}": value for name, value in _numbers(clean).items()})
            events.flush()

        self._guarded("_events", step, scalars)

    def start(self, step: int, texts: dict[str, str], hparams: dict[str, Any]) -> None:
        """This start of the run: a "start" line in metrics.jsonl (with the hyperparameters, for plots), the
        Text tab's entries ``{tag: markdown}`` at ``step`` and the HParams session's start."""
        if not self.enabled:
            return
        record = {"step": step, "kind": "start", "wall_time": time.time(), "start": self.earlier_starts + 1}
        self._guarded("_metrics", step, lambda m: m.line({**record, "hparams": hparams}))

        def write(events) -> None:
            for tag, markdown in texts.items():
                events.text(step, tag, markdown)
            events.hparams_start(step, hparams)
            events.flush()

        self._guarded("_events", step, write)

    def end(self, step: int) -> None:
        """The HParams session's end: the run has finished (max_steps or max_epochs), not merely stopped."""
        if self.enabled:
            self._guarded("_events", step, lambda events: (events.hparams_end(step), events.flush()))

    def close(self) -> None:
        self._guarded("_metrics", None, lambda m: m.close())
        self._guarded("_events", None, lambda e: e.close())
        self._metrics = self._events = None
