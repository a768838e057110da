"""What keeps the ranks of a run together: stop requests, no orphaned ranks, one failure message for all ranks.

**Stop requests.** SIGTERM, SIGINT and SIGHUP (unless ignored, as under ``nohup``) only set a reason; the training
loop agrees on it at the next step boundary, writes a checkpoint and exits 0.

**No orphaned ranks.** The process that started a job can go without the ranks hearing of it. With DeepSpeed the
chain on a node is ``deepspeed`` (the runner) -> ``python -m deepspeed.launcher.launch`` -> the ranks. On one node
the runner has no signal handler: SIGTERM or SIGINT to its PID ends it, ``launch`` is adopted by PID 1 and the
ranks train on. Under ``--hostfile`` the runner starts ``pdsh``, which starts ``launch`` on every node over ssh
(the chain on a node is sshd -> a shell -> launch -> ranks, and the ranks write into the ssh connection); with
``--no_ssh`` under Slurm (launchers/slurm.sbatch) it is srun's slurmstepd -> the runner -> launch -> ranks. So
each rank watches, every `WATCH_S` seconds, (1) its parent (launch, or torchrun's agent), (2) when the parent is
DeepSpeed's launch, the process that started it (the runner, or the remote shell), and (3) when its output is a
pipe or a socket, whether the reading end is still there (a dead ssh connection or runner). When any is gone it
asks for a stop exactly like SIGTERM; the stop-flag all-reduce tells the other ranks, including those on nodes
that noticed nothing. (A parent-death signal is no use: the ranks' parent, launch, survives.)

**One failure, one message.** A rank that fails (a bad file, a full disk, a damaged shard) reports its one-line
message through the rendezvous store of torch.distributed (``MASTER_ADDR:MASTER_PORT``); the first report is
printed, once, by the rank that made it. Every other rank sees the report within a second and exits quietly with
status 1, even when it is blocked in a collective that would otherwise wait for the dead rank (NCCL) or end in a
gloo "Connection closed by peer". Rank 0's cleanups (releasing the run lock, removing a checkpoint it was writing)
run on every exit path.
"""

from __future__ import annotations

import datetime
import logging
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
import traceback
from typing import Any, Callable, NoReturn

log = logging.getLogger("txl_dist.training")

WATCH_S = 0.25
"""Seconds between two looks at the launcher chain and the output pipes."""
STORE_EVERY = 4
"""Look at the failure store every this many watch periods (one second)."""
GRACE_S = 3.0
"""After another rank's failure: how long this rank's own code may take to exit before the watchdog ends it."""
# torchrun's agent keeps its store across the restarts of a job's workers: the keys are per attempt.
_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
FAILURE_KEY = f"txl_dist/{_ATTEMPT}/failure"
SEEN_KEY = f"txl_dist/{_ATTEMPT}/failure_seen"

# Errors whose message says everything: printed as one line, without a traceback. Anything else is a bug (ours or
# a library's) and keeps its traceback.
ONE_LINE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyboardInterrupt)


class RunFailure(Exception):
    """A failure the ranks agreed on (every rank raises it with the same message)."""


def _describe(error: BaseException) -> str:
    from txl_dist.fileio import describe_os_error

    if isinstance(error, OSError):
        return describe_os_error(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return str(error)


def _print(message: str) -> None:
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the reader of our output is gone: the exit status still tells
        pass


def _process_identity(pid: int) -> tuple[int, float, list[str]] | None:
    import psutil

    try:
        process = psutil.Process(pid)
        return pid, process.create_time(), process.cmdline()
    except (psutil.Error, OSError):
        return None


def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        return psutil.Process(pid).create_time() == create_time
    except (psutil.Error, OSError):
        return False


def _launcher_chain() -> list[tuple[int, float, str]]:
    """(pid, create time, what it is) of the processes whose exit means the job is gone; empty for a process
    started by hand (its parent is a shell or a job manager, which may exit under nohup)."""
    parent = _process_identity(os.getppid())
    if parent is None:
        return []
    command = " ".join(parent[2])
    if "deepspeed.launcher.launch" in command:
        chain = [(parent[0], parent[1], "DeepSpeed's per-node launcher")]
        starter = _process_identity(_parent_of(parent[0]))
        if starter is not None and starter[0] > 1:
            what = "the deepspeed runner" if any("deepspeed" in part for part in starter[2]) else "the process that started this node's launcher"
            chain.append((starter[0], starter[1], what))
        return chain
    if "torchrun" in command or "torch.distributed.run" in command or "torch.distributed.launch" in command:
        return [(parent[0], parent[1], "torchrun")]
    return []


def _parent_of(pid: int) -> int:
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except (psutil.Error, OSError):
        return 0


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


class RunGuard:
    """One per rank, created as early as possible (before the heavy imports); `connect` after the process group
    exists. ``reason`` is the stop request, None while there is none."""

    def __init__(self, watch_launcher: bool = True, install_signals: bool = True):
        self.reason: str | None = None
        self.rank, self.world_size = 0, 1
        self._previous: dict[int, Any] = {}
        if install_signals and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                    continue  # nohup: the user asked to survive the terminal
                self._previous[signum] = signal.signal(signum, self._on_signal)
        self._chain = _launcher_chain() if watch_launcher else []
        self._parent = os.getppid()
        self._pipes = _output_pipes() if self._chain else []
        self._store = None
        self._store_errors_since: float | None = None
        self._failure_seen_at: float | None = None
        self._reported = False
        self._acknowledged = False
        self._cleanups: list[Callable[[], None]] = []
        self._cleanup_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="txl_dist-guard", daemon=True)
        self._thread.start()

    # ---- stop requests -----------------------------------------------------------------------------------------

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request_stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def _on_signal(self, signum, frame) -> None:
        self.request_stop(signal.Signals(signum).name)

    def _launcher_gone(self) -> str | None:
        if self._chain and os.getppid() != self._parent:
            return f"{self._chain[0][2]} (PID {self._parent}) exited"
        for pid, create_time, what in self._chain:
            if not _alive(pid, create_time):
                return f"{what} (PID {pid}) exited"
        if self._pipes:
            poller = select.poll()
            for fd in self._pipes:
                poller.register(fd, 0)  # POLLERR/POLLHUP are always reported
            if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
                return "the reader of its output (the launcher or its ssh connection) is gone"
        return None

    # ---- failures ----------------------------------------------------------------------------------------------

    def connect(self, rank: int, world_size: int) -> None:
        """Join the failure channel: the rendezvous store that torch.distributed's env:// start-up created (every
        launcher sets MASTER_ADDR and MASTER_PORT)."""
        self.rank, self.world_size = rank, world_size
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size <= 1 or not address or not port:
            return
        import torch.distributed as dist

        try:
            self._store = dist.TCPStore(address, int(port), is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=30))
        except (RuntimeError, ValueError, OSError) as error:
            log.warning("rank %d: no failure channel (%s): a failure on another rank may end this one only "
                        "through the launcher", rank, error)

    def on_abort(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` (once) if the run fails, on whichever thread ends the process."""
        self._cleanups.append(cleanup)

    def run_cleanups(self) -> None:
        with self._cleanup_lock:
            cleanups, self._cleanups = self._cleanups, []
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception as error:  # a cleanup must not hide the failure
                log.warning("cleanup after the failure failed: %s", error)

    def failure_reported(self, wait_s: float = 0.0) -> bool:
        """Whether some rank has reported a failure (waiting up to ``wait_s`` seconds for one)."""
        if self._failure_seen_at is not None:
            return True
        if self._store is None:
            return False
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._store.check([FAILURE_KEY]):
                    return True
            except Exception:  # the store went with rank 0
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def fail(self, error: BaseException) -> NoReturn:
        """End this rank after ``error``: print it (one line for the errors that say everything, else with the
        traceback) unless another rank's failure came first, run the cleanups, exit with status 1."""
        self._closed.set()
        caused_elsewhere = not isinstance(error, RunFailure) and self.failure_reported(wait_s=0.5)
        if not caused_elsewhere:
            one_line = isinstance(error, ONE_LINE_ERRORS + (RunFailure,))
            where = f" on rank {self.rank} ({socket.gethostname()})" if self.world_size > 1 else ""
            message = f"train.py: error{where}: {_describe(error)}"
            if not one_line:
                message = "".join(traceback.format_exception(error)).rstrip() + "\n" + message
            if self._report(message):
                _print(message)
                self._wait_for_the_others()
            else:
                self._acknowledge()
        else:
            self._acknowledge()
        self.run_cleanups()
        self._exit(1)

    def _report(self, message: str) -> bool:
        """Record the failure; True when it is the first (so this rank prints it)."""
        self._reported = True
        if self._store is None:
            return True
        mine = f"{self.rank}\n{message}"
        try:
            return self._store.compare_set(FAILURE_KEY, "", mine).decode("utf-8", "replace") == mine
        except Exception:
            return True

    def _acknowledge(self) -> None:
        """Tell rank 0, which keeps the store alive for it, that this rank has seen the failure."""
        if self._store is None or self._acknowledged:
            return
        self._acknowledged = True
        try:
            self._store.add(SEEN_KEY, 1)
        except Exception:
            pass

    def _wait_for_the_others(self) -> None:
        """The store lives in rank 0: when it fails, it stays until the other ranks have read the report."""
        if self._store is None or self.rank != 0:
            return
        deadline = time.monotonic() + 2 * GRACE_S
        while time.monotonic() < deadline:
            try:
                if self._store.add(SEEN_KEY, 0) >= self.world_size - 1:
                    return
            except Exception:
                return
            time.sleep(0.1)

    @staticmethod
    def _exit(status: int) -> NoReturn:
        # Not sys.exit: tearing down a process group whose peers are gone can hang or abort the interpreter.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    # ---- the watchdog ------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        tick = 0
        while not self._closed.wait(WATCH_S):
            tick += 1
            if self.reason is None:
                gone = self._launcher_gone()
                if gone:
                    log.warning("rank %d: %s; stopping with a checkpoint as on SIGTERM", self.rank, gone)
                    self.request_stop(gone)
            if self._store is not None and tick % STORE_EVERY == 0:
                self._watch_failures()

    def _watch_failures(self) -> None:
        now = time.monotonic()
        if self._failure_seen_at is None:
            try:
                reported = self._store.check([FAILURE_KEY])
                self._store_errors_since = None
            except Exception:
                # Rank 0 is gone with the store. A normal end can race with this look, hence the delay.
                self._store_errors_since = self._store_errors_since or now
                if now - self._store_errors_since > 10.0:
                    _print(f"train.py: rank {self.rank} ({socket.gethostname()}): lost contact with rank 0; stopping")
                    self.run_cleanups()
                    self._exit(1)
                return
            if not reported:
                return
            self._failure_seen_at = now
            if not self._reported:
                self._acknowledge()
        if not self._reported and now - self._failure_seen_at > GRACE_S:
            # This rank's own code has not ended it: it is blocked in a collective with the failed rank.
            self.run_cleanups()
            self._exit(1)

    def close(self) -> None:
        """The run is over: stop watching and restore the signal handlers."""
        self._closed.set()
        for signum, handler in self._previous.items():
            try:
                signal.signal(signum, handler)
            except ValueError:  # not the main thread
                pass
        self._previous.clear()
