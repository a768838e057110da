"""No orphaned ranks: noticing that the processes that started this rank, or the reader of its output, are gone.

The process that started a job can go without the ranks hearing of it. With DeepSpeed the chain on a node is
``deepspeed`` (the runner) -> ``python -m deepspeed.launcher.launch`` -> the ranks. On one node the runner has no
signal handler: SIGTERM or SIGINT to its PID ends it, ``launch`` is adopted by PID 1 and the ranks train on. Under
``--hostfile`` the runner starts ``pdsh``, which starts ``launch`` on every node over ssh (the chain on a node is
sshd -> a shell -> launch -> ranks, and the ranks write into the ssh connection); with ``--no_ssh`` under Slurm
(launchers/slurm.sbatch) it is srun's slurmstepd -> the runner -> launch -> ranks. So each rank watches (1) its
parent (launch, or torchrun's agent), (2) when the parent is DeepSpeed's launch, the process that started it (the
runner, or the remote shell), and (3) when its output is a pipe or a socket, whether the reading end is still there
(a dead ssh connection or runner). (A parent-death signal is no use: the ranks' parent, launch, survives.)

What a rank does then depends on the command: the trainer checkpoints first (`txl_dist.supervision.guard` asks
`LauncherWatch.gone` in its own watchdog); a command with nothing to save (launchers/evaluate.py) stops at once
through `watching_launcher`, the same watch on a thread of its own.
"""

from __future__ import annotations

import os
import select
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

from txl_dist.supervision.processes import process_start, same_process


def _process(pid: int) -> tuple[int, list[str]] | None:
    """(start time, command line) of a process; None when it is gone."""
    start = process_start(pid)
    try:
        command_line = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):
        return None
    return (start, command_line) if start is not None else None


def _parent_of(pid: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except (psutil.Error, OSError):
        return 0


def launcher_chain() -> list[tuple[int, int, str]]:
    """(pid, start time, what it is) of the processes whose exit means the job is gone; empty for a process
    started by hand (its parent is a shell or a job manager, which may exit under nohup)."""
    parent_pid = os.getppid()
    parent = _process(parent_pid)
    if parent is None:
        return []
    command = " ".join(parent[1])
    if "deepspeed.launcher.launch" in command:
        chain = [(parent_pid, parent[0], "DeepSpeed's per-node launcher")]
        starter_pid = _parent_of(parent_pid)
        starter = _process(starter_pid) if starter_pid > 1 else None
        if starter is not None:
            what = (
                "the deepspeed runner"
                if any("deepspeed" in part for part in starter[1])
                else "the process that started this node's launcher"
            )
            chain.append((starter_pid, starter[0], what))
        return chain
    if "torchrun" in command or "torch.distributed.run" in command or "torch.distributed.launch" in command:
        return [(parent_pid, parent[0], "torchrun")]
    return []


def _output_pipes() -> list[int]:
    """stdout/stderr when they are pipes or sockets (a terminal or a file cannot tell that its reader left)."""
    fds = []
    for fd in (1, 2):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            fds.append(fd)
    return fds


class LauncherWatch:
    """What this rank watches, found once at start-up; `gone` is asked every watch period."""

    def __init__(self, enabled: bool = True):
        self.chain = launcher_chain() if enabled else []
        self.parent = os.getppid()
        self.pipes = _output_pipes() if self.chain else []

    def gone(self) -> str | None:
        """Why the job is gone (which process exited, or that the output's reader left); None while it is not."""
        if self.chain and os.getppid() != self.parent:
            return f"{self.chain[0][2]} (PID {self.parent}) exited"
        for pid, start, what in self.chain:
            if not same_process(pid, start):
                return f"{what} (PID {pid}) exited"
        if self.pipes:
            poller = select.poll()
            for fd in self.pipes:
                poller.register(fd, 0)  # POLLERR/POLLHUP are always reported
            if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
                return "the reader of its output (the launcher or its ssh connection) is gone"
        return None


WATCH_S = 0.25
"""Seconds between two looks at the launcher chain and the output pipes (the trainer's watchdog's period too)."""


@contextmanager
def watching_launcher(on_gone: Callable[[str], None], period_s: float = WATCH_S) -> Iterator[LauncherWatch]:
    """While the block runs, a daemon thread calls ``on_gone(why)`` once, from that thread, when the processes that
    started this one or the reader of its output are gone (`LauncherWatch.gone`); no thread when no launcher
    started this process. For the ranks of the commands that have no checkpoint to write, as the trainer has:
    ``on_gone`` ends the process (`txl_dist.supervision.interrupts.stop_this_process`)."""
    watch = LauncherWatch()
    done = threading.Event()

    def look() -> None:
        while not done.wait(period_s):
            why = watch.gone()
            if why is not None:
                on_gone(why)
                return

    if watch.chain:
        threading.Thread(target=look, name="txl_dist-launcher-watch", daemon=True).start()
    try:
        yield watch
    finally:
        done.set()
