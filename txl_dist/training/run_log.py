"""Where a run's reports are written, from rank 0 only: console lines, ``metrics.jsonl`` and a TensorBoard event
file (scalars, the Text tab's run information at every start, the HParams dashboard's session). `RunLogger` is the
one object the training loop calls; what the lines and entries say is `txl_dist.training.step_log`.

Every other rank gets the same object with ``enabled=False``, so call sites need no rank checks. On resume the
records after the resumed step (written before an interruption, then lost with it) are dropped from
``metrics.jsonl`` and TensorBoard (a purge from the next step on), so both read as one uninterrupted run: one
value per step. The records of numerical faults, rollbacks and skipped windows (kind ``numerics``) stay: they
tell what the run went through. A rollback in the same process (`txl_dist.training.numerics`) purges TensorBoard
from the step after the restored one (`rolled_back`); ``metrics.jsonl`` keeps the steps before it, whose later
record of a step is the one that stands.

Logging never stops training: a sink that fails (its folder removed or replaced mid-run, a full disk, an
unwritable file) is dropped with one warning line naming its path and the cause, and the run goes on with the
others (the console always).

The TensorBoard event file (`EventFile`) is written by the training process itself. torch's SummaryWriter hands
events to a thread of its own, which reopens the file by its path at every flush: a
run whose ``tensorboard/`` folder was removed or replaced got an 18-line traceback from that thread, then the
same error in the training loop, and stopped without a checkpoint. Here every record is written by the caller to
a file opened once, so a failure is an exception in the caller (`RunLogger` turns it into one warning). A file
that is removed or replaced mid-run is noticed at the next flush: its path no longer names the open file, whose
events would otherwise go on into an unlinked inode, lost without a word.

The HParams summaries go into this event file, not into the sub-run that ``SummaryWriter.add_hparams`` creates
per call (a folder named by the time, holding the metrics' values at that moment): so a run stays one TensorBoard
run, its metrics are the last values of its own scalars (``eval/loss``, ``best/loss``, ...) as evaluations come,
and ``tensorboard --logdir`` over a sweep's parent folder compares the runs in one HParams table. TensorBoard keeps
the first session start it reads for a run (the summary metadata of a tag's first event), so a resumed run stays
one session.

Both files are written for the whole run: a path that no longer names the open file (the file or its folder
removed or replaced by a user or a cleanup job) is found at the next flush (`require_same_file`), instead of the
run writing on into a file nobody can see.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from txl_dist.fileio import atomic_write_text, describe_os_error, ensure_directory
from txl_dist.run_paths import METRICS, TENSORBOARD


class FileGone(RuntimeError):
    """A file's path no longer names the file being written (it or its folder was removed or replaced)."""


def file_identity(handle) -> tuple[int, int]:
    """(device, inode) of an open file."""
    status = os.fstat(handle.fileno())
    return status.st_dev, status.st_ino


def require_same_file(path: Path, identity: tuple[int, int]) -> None:
    """FileGone unless ``path`` still names the file of ``identity`` (`file_identity` of the open file)."""
    try:
        status = os.stat(path)
        same = (status.st_dev, status.st_ino) == identity
    except (FileNotFoundError, NotADirectoryError):  # removed, or its folder replaced by a file
        same = False
    if not same:
        raise FileGone(f"{path}: removed or replaced while the run was writing it")


_FILE_NUMBER = itertools.count()
"""Two event files opened by one process in the same second still get two names."""


class EventFile:
    """One event file under ``directory``. ``purge_step``: TensorBoard drops the events of earlier files from
    this step on (those of an interrupted run after the checkpoint it resumes from)."""

    name = "tensorboard"

    def __init__(self, directory: str | os.PathLike, purge_step: int | None = None):
        directory = ensure_directory(directory)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILE_NUMBER)}"
        self.path = Path(directory) / name
        self._file = open(self.path, "xb")
        self._records = RecordWriter(self._file)
        self._identity = file_identity(self._file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def _write(self, event: Event) -> None:
        self._records.write(event.SerializeToString())

    def _summary(self, step: int, values: list[Summary.Value]) -> None:
        self._write(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """``{tag: value}`` at ``step``."""
        self._summary(step, [Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])

    def text(self, step: int, tag: str, markdown: str) -> None:
        """One entry of the Text tab (TensorBoard renders it as Markdown)."""
        tensor = tensor_util.make_tensor_proto(markdown.encode("utf-8"))  # a scalar: rendered as one Markdown text
        summary_metadata = text_metadata.create_summary_metadata(display_name=tag, description="")
        self._summary(step, [Summary.Value(tag=tag, metadata=summary_metadata, tensor=tensor)])

    def hparams_start(self, step: int, hparams: dict[str, float | int | str | bool]) -> None:
        """This session's start with its hyperparameters' values. No experiment summary: TensorBoard then builds
        the experiment from every run's session (which hyperparameters differ between the runs, shown first) and
        takes the runs' scalars as the metrics; an experiment summary in each run would be one run's alone, with
        nothing marked as differing."""
        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for name, value in hparams.items():
            if isinstance(value, bool):
                start.hparams[name].bool_value = value
            elif isinstance(value, (int, float)):
                start.hparams[name].number_value = float(value)
            else:
                start.hparams[name].string_value = str(value)
        data = plugin_data_pb2.HParamsPluginData(session_start_info=start)
        self._hparams(step, hparams_metadata.SESSION_START_INFO_TAG, data)

    def hparams_end(self, step: int, status: str = "STATUS_SUCCESS") -> None:
        """This session's end (``api_pb2.Status``'s names)."""
        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value(status), end_time_secs=time.time())
        data = plugin_data_pb2.HParamsPluginData(session_end_info=end)
        self._hparams(step, hparams_metadata.SESSION_END_INFO_TAG, data)

    def _hparams(self, step: int, tag: str, data: plugin_data_pb2.HParamsPluginData) -> None:
        value = Summary.Value(
            tag=tag, metadata=hparams_metadata.create_summary_metadata(data), tensor=hparams_metadata.NULL_TENSOR
        )
        self._summary(step, [value])

    def restart_at(self, step: int) -> None:
        """TensorBoard drops this file's earlier events from ``step`` on (a rollback's replay writes them anew)."""
        self._write(Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))

    def flush(self) -> None:
        """Write out what is buffered; `FileGone` when the file's path now names
        another file or nothing."""
        self._records.flush()
        require_same_file(self.path, self._identity)

    def close(self) -> None:
        self._records.close()


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
    """Drop the records after ``step`` but those of numerical faults (rewritten atomically); return the "start"
    records kept."""
    if not path.is_file():
        return 0
    kept, starts = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(record, dict) and (record.get("step", 0) <= step or record.get("kind") == "numerics"):
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

    def warning(self, message: str, *args: Any) -> None:
        if self.enabled:
            log.warning(message, *args)

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

    def start(
        self, step: int, texts: dict[str, str], hparams: dict[str, Any], facts: dict[str, Any] | None = None
    ) -> None:
        """This start of the run: a "start" line in metrics.jsonl (with the hyperparameters, for plots, and
        ``facts``: where the run started from), the Text tab's entries ``{tag: markdown}`` at ``step`` and the
        HParams session's start."""
        if not self.enabled:
            return
        record = {"step": step, "kind": "start", "wall_time": time.time(), "start": self.earlier_starts + 1}
        record.update(facts or {})
        self._guarded("_metrics", step, lambda m: m.line({**record, "hparams": hparams}))

        def write(events) -> None:
            for tag, markdown in texts.items():
                events.text(step, tag, markdown)
            events.hparams_start(step, hparams)
            events.flush()

        self._guarded("_events", step, write)

    def rolled_back(self, step: int) -> None:
        """The run went back to ``step`` in this process: TensorBoard shows the replay's values from the next step."""
        if self.enabled:
            self._guarded("_events", step, lambda events: (events.restart_at(step + 1), events.flush()))

    def end(self, step: int) -> None:
        """The HParams session's end: the run has finished (max_steps or max_epochs), not merely stopped."""
        if self.enabled:
            self._guarded("_events", step, lambda events: (events.hparams_end(step), events.flush()))

    def close(self) -> None:
        self._guarded("_metrics", None, lambda m: m.close())
        self._guarded("_events", None, lambda e: e.close())
        self._metrics = self._events = None
