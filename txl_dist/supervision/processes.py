"""Which process a PID is on this host: its start time, and how it ended while it is still a zombie.

A PID is recycled once its process is gone, so a process is named by its PID and its start time. The start time is
the one in ``/proc/PID/stat``: clock ticks since the host booted. That count never changes for a process, whereas a
start time in seconds since the epoch (``psutil.Process.create_time``) is derived from the wall clock and moves
when the clock is set or slewed, which would make a live run look like another process. The run lock records this
start time in ``run.lock`` (``pid_start``) and the ranks publish it to each other.
"""

from __future__ import annotations

import signal
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first); None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold spaces and parentheses


def process_start(pid: int) -> int | None:
    """The start time of a process in clock ticks since boot (field 22 of ``/proc/PID/stat``); None when it is
    gone."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def same_process(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (a zombie included: it has not been
    collected yet)."""
    return process_start(pid) == start


def how_it_ended(pid: int, start: int) -> str | None:
    """None while the process that started at ``start`` runs; else how it ended where this can still be read (its
    parent has not collected it yet): ``killed by SIGKILL``, ``exited with status 1``, or ``""``."""
    fields = _stat_fields(pid)
    if fields is None or int(fields[19]) != start:
        return ""
    if fields[0] != "Z":
        return None
    status = int(fields[-1])  # exit_code, in waitpid's form
    if not status & 0x7F:
        return f"exited with status {status >> 8}"
    try:
        return f"killed by {signal.Signals(status & 0x7F).name}"
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {status & 0x7F}"
