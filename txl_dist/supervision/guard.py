"""What keeps the ranks of a run together: stop requests, no orphaned ranks, one failure message for all ranks.

**Stop requests.** SIGTERM, SIGINT and SIGHUP (unless ignored, as under ``nohup``) only set a reason; the training
loop agrees on it at the next step boundary, writes a checkpoint and exits 0.

**No orphaned ranks.** Each rank watches the processes that started it and the reader of its output
(`txl_dist.supervision.launcher_watch`); when any is gone it asks for a stop exactly like SIGTERM, and the stop-flag
all-reduce tells the other ranks, including those on nodes that noticed nothing.

**One failure, one message.** A rank that fails (a bad file, a full disk, a damaged shard) reports its one-line
message through the rendezvous store of torch.distributed (``MASTER_ADDR:MASTER_PORT``); the first report is
printed, once, by the rank that made it. Every other rank sees the report within a second and exits quietly with
status 1, even when it is blocked in a collective that would otherwise wait for the dead rank (NCCL) or end in a
gloo "Connection closed by peer". Rank 0's cleanups (releasing the run lock, removing a checkpoint it was writing)
run on every exit path.

**Liveness.** Every rank's heartbeat goes into the same store (`txl_dist.supervision.heartbeats`). A rank whose
heartbeat has not moved for ``stall_timeout`` seconds is named in one line (rank, host, PID, step) and the job ends
with status 1 so that the scheduler can requeue it. When a rank dies without a word, the collectives of the others
fail: they name it, with its signal where it can be read, instead of printing the communication library's
traceback.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from txl_dist.exit_status import USAGE_ERROR, CommandFailure, ReportedByRankZero, os_error_status
from txl_dist.fileio import describe_os_error
from txl_dist.supervision import faults
from txl_dist.supervision.heartbeats import HEARTBEAT_EVERY, STALL_CHECK_EVERY, STORE_PREFIX, Heartbeats
from txl_dist.supervision.launcher_watch import WATCH_S, LauncherWatch

log = logging.getLogger("txl_dist.training")

STORE_EVERY = 4
"""Look at the failure store every this many watch periods (one second)."""
GRACE_S = 3.0
"""After another rank's failure: how long this rank's own code may take to exit before the watchdog ends it."""
FAILURE_KEY = STORE_PREFIX + "failure"
SEEN_KEY = STORE_PREFIX + "failure_seen"

# Errors whose message says everything: printed as one line, without a traceback. Anything else is a bug (ours or
# a library's) and keeps its traceback.
ONE_LINE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyboardInterrupt, CommandFailure)


class RunFailure(Exception):
    """A failure the ranks agreed on (every rank raises it with the same message). A subclass may name the exit
    status every rank ends with (``exit_status``), the kind of its fault record (``fault_kind``), and that every
    rank found it alike (``found_by_every_rank``: its message names no rank)."""

    exit_status = 1
    fault_kind = "error"
    found_by_every_rank = False


def _error_text(error: BaseException) -> str:
    """The one-line text of ``error``: an OSError with its file, ``interrupted`` for Ctrl-C, else its message."""
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


def _refused_input(error: BaseException) -> bool:
    """Whether ERROR refuses the run's input (exit_status: a ValueError, or an OSError about a path the user named
    wrongly): the same input would be refused again."""
    if isinstance(error, ValueError):
        return True
    return isinstance(error, OSError) and os_error_status(error) == USAGE_ERROR


def _slurm_step() -> str | None:
    """``JOB.STEP`` of the Slurm step this rank runs in (None outside one)."""
    job, step = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_STEP_ID")
    return f"{job}.{step}" if job and step else None


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
        self._launcher = LauncherWatch(enabled=watch_launcher)
        self._store = None
        self._heartbeats: Heartbeats | None = None
        self._store_errors_since: float | None = None
        self._failure_seen_at: float | None = None
        self._reported = False
        self._acknowledged = False
        self._cleanups: list[Callable[[], None]] = []
        self._cleanup_lock = threading.Lock()
        self._closed = threading.Event()
        self.step = 0
        self.last_checkpoint: int | None = None
        self.last_snapshot: int | None = None
        self.stall_timeout: float | None = None
        """train.stall_timeout, from `connect` on (no heartbeat is followed before)."""
        self.fault_log: Path | None = None
        """The run's faults.jsonl (`txl_dist.supervision.faults`), once the run folder is known: the rank that prints
        the run's failure message records it there too, for the batch script that decides what comes next."""
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

    # ---- failures ----------------------------------------------------------------------------------------------

    def progress(self, step: int) -> None:
        """The training loop finished ``step`` (the step named in a stall or death message)."""
        self.step = step

    def checkpointed(self, step: int) -> None:
        self.last_checkpoint = step

    def snapshotted(self, step: int | None) -> None:
        """This rank's memory snapshot of ``step`` is taken (checkpoint.memory_every): a failure loses less; None:
        none newer than the last checkpoint is known (a rollback)."""
        self.last_snapshot = step

    def connect(self, rank: int, world_size: int, stall_timeout: float) -> None:
        """Join the failure channel: the rendezvous store that torch.distributed's env:// start-up created (every
        launcher sets MASTER_ADDR and MASTER_PORT); a rank whose heartbeat stops for ``stall_timeout`` seconds
        (train.stall_timeout) is named."""
        self.rank, self.world_size = rank, world_size
        self.stall_timeout = stall_timeout
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size <= 1 or not address or not port:
            return
        # lazy: launchers/train.py imports this module first, so that the guard is in place before torch loads
        # (import torch.distributed: 0.9 s); this module stays free of torch until a rank connects
        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                address, int(port), is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
            )
        except (RuntimeError, ValueError, OSError) as error:
            log.warning(
                "rank %d: no failure channel (%s): a failure on another rank may end this one only "
                "through the launcher",
                rank,
                error,
            )
            return
        self._heartbeats = Heartbeats(store, rank, world_size)  # before the store: the watch thread tests that
        self._store = store
        try:
            self._heartbeats.join(self.step)
        except Exception:
            pass

    # ---- liveness ----------------------------------------------------------------------------------------------

    def _who(self, rank: int) -> str:
        return self._heartbeats.who(rank) if self._heartbeats is not None else f"rank {rank}"

    def _since_checkpoint(self) -> str:
        since = f"step {self.last_checkpoint}" if self.last_checkpoint is not None else "the start of this run"
        snapshot = self.last_snapshot
        if snapshot is not None and (self.last_checkpoint is None or snapshot > self.last_checkpoint):
            return (
                f"the job's progress since its last checkpoint ({since}) is kept up to step {snapshot} by the memory "
                "snapshots where every rank's part of one survives in some node's memory (else it is lost); run the "
                "same command again to resume from the newest"
            )
        return (
            f"the job's progress since its last checkpoint ({since}) is lost; run the same command again to "
            "resume from it"
        )

    def _stalled(self, rank: int, seconds: float) -> NoReturn:
        message = (
            f"train.py: error: {self._who(rank)} has made no progress for {seconds:.0f} s "
            f"(train.stall_timeout={self.stall_timeout:g}), at step {self._heartbeats.step_of(rank)}: its process "
            f"is stopped or its host or network is down; ending the job; {self._since_checkpoint()}"
        )
        self._closed.set()
        if self._report(message):
            self._record("stalled", rank, message, step=self._heartbeats.step_of(rank))
            _print(message)
            self._wait_for_the_others()
        self.run_cleanups()
        self._exit(1)

    def _host_of(self, rank: int) -> str | None:
        if rank == self.rank:
            return socket.gethostname()
        return self._heartbeats.host_of(rank) if self._heartbeats is not None else None

    def _record(self, kind: str, rank: int, message: str, step: int | str | None = None) -> None:
        """The failure in the run's fault log (when it is known): KIND (`txl_dist.supervision.faults`), the rank it
        names and that rank's host. Never in the way of the exit: a log that cannot be written is left out."""
        if self.fault_log is None:
            return
        step = self.step if step is None else step
        record = {
            "kind": kind,
            "rank": rank,
            "host": self._host_of(rank),
            "step": int(step) if isinstance(step, int) or str(step).isdigit() else None,
            "message": message.strip().splitlines()[-1] if message.strip() else "",
            "reporter": self.rank,
            "world_size": self.world_size,
            "launch": os.environ.get(faults.LAUNCH_VAR),
            "slurm_step": _slurm_step(),
        }
        try:
            faults.append(self.fault_log, record)
        except FileNotFoundError:  # before the run folder was made: nothing of the run to resume either
            pass
        except OSError as error:
            log.warning("rank %d: the fault log %s cannot be written: %s", self.rank, self.fault_log, error)

    def dead_peers(self, wait_s: float = 3.0) -> list[tuple[int, str]]:
        """Ranks that are gone, with how they went where it can be read: peers on this host by their process,
        the others by a heartbeat that stops moving within ``wait_s``."""
        return self._heartbeats.dead_peers(wait_s) if self._heartbeats is not None else []

    def death_message(self, dead: list[tuple[int, str]]) -> str:
        rank, how = dead[0]
        how = how or ("killed by a signal it cannot catch (SIGKILL, as the kernel's OOM killer sends) or crashed")
        more = f" (and {len(dead) - 1} more ranks)" if len(dead) > 1 else ""
        return (
            f"{self._who(rank)} died{more} without reporting an error: {how}; this rank was at step "
            f"{self.step}; {self._since_checkpoint()}"
        )

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
        traceback) unless another rank's failure came first, run the cleanups, exit with status 1 (or the
        `RunFailure`'s own)."""
        self._closed.set()
        status = error.exit_status if isinstance(error, RunFailure) else 1
        if isinstance(error, ReportedByRankZero):
            self.run_cleanups()
            self._exit(1)
        caused_elsewhere = not isinstance(error, RunFailure) and self.failure_reported(wait_s=0.5)
        if not caused_elsewhere:
            one_line = isinstance(error, ONE_LINE_ERRORS + (RunFailure,))
            agreed = getattr(error, "found_by_every_rank", False)  # no rank of its own to name
            where = f" on rank {self.rank} ({socket.gethostname()})" if self.world_size > 1 and not agreed else ""
            message = f"train.py: error{where}: {_error_text(error)}"
            dead = self.dead_peers() if not one_line and self.world_size > 1 else []
            kind = (
                error.fault_kind if isinstance(error, RunFailure) else "refused" if _refused_input(error) else "error"
            )
            named = self.rank
            if dead:  # the communication library's error is only the echo of a rank that died
                one_line, message = True, f"train.py: error: {self.death_message(dead)}"
                kind, named = "died", dead[0][0]
            if not one_line:
                message = "".join(traceback.format_exception(error)).rstrip() + "\n" + message
            if self._report(message):
                self._record(kind, named, message, step=getattr(error, "step", None))
                _print(message)
                self._wait_for_the_others()
            else:
                self._acknowledge()
        else:
            self._acknowledge()
        self.run_cleanups()
        self._exit(status)

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
                gone = self._launcher.gone()
                if gone:
                    log.warning("rank %d: %s; stopping with a checkpoint as on SIGTERM", self.rank, gone)
                    self.request_stop(gone)
            if self._store is not None and tick % STORE_EVERY == 0:
                self._watch_failures()
            if self._store is not None and self.world_size > 1:
                try:
                    if tick % HEARTBEAT_EVERY == 0:
                        self._heartbeats.beat(self.step)
                    if tick % STALL_CHECK_EVERY == 0:
                        stalled = self._heartbeats.stalled(time.monotonic(), self.stall_timeout)
                        if stalled is not None and self._failure_seen_at is None and not self._reported:
                            self._stalled(*stalled)
                except Exception:  # the store went with rank 0: _watch_failures says so
                    pass

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
                    message = (
                        f"train.py: error on rank {self.rank} ({socket.gethostname()}): lost contact with "
                        f"{self._who(0)} at step {self._heartbeats.step_of(0)} (gone, stopped, or its network is "
                        f"down); stopping; {self._since_checkpoint()}"
                    )
                    self._record("lost_contact", 0, message)
                    _print(message)
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
