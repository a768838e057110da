"""A TensorBoard event file written by the training process itself: scalars, text, and the HParams plugin's
session summaries, in the run's own folder.

torch's SummaryWriter hands events to a thread of its own, which reopens the file by its path at every flush: a
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
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.text import metadata as text_metadata
from tensorboard.summary.writer.record_writer import RecordWriter
from tensorboard.util import tensor_util

from txl_dist.fileio import ensure_directory
from txl_dist.training.run_files import file_identity, require_same_file

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

    def flush(self) -> None:
        """Write out what is buffered; `txl_dist.training.run_files.FileGone` when the file's path now names
        another file or nothing."""
        self._records.flush()
        require_same_file(self.path, self._identity)

    def close(self) -> None:
        self._records.close()
