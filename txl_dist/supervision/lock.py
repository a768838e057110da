"""One run per output directory: a lock file that works on the shared filesystems of clusters.

Why not ``flock``: on NFS, Linux emulates ``flock`` with whole-file POSIX locks that depend on the lock manager
(NLM, or NFSv4 state) and, after a client crash, are freed only when its lease expires; on Lustre, ``flock`` is
coherent across nodes only with the ``flock`` mount option -- ``localflock`` (common, it is cheaper) grants locks
that only the same node sees, so two runs on two nodes would both "hold" it, and ``noflock`` refuses the call.
A lock that cannot be trusted on the filesystems the runs use is worse than none.

So the lock is a file, ``{output_dir}/run.lock``, created atomically with ``link(2)`` (atomic on NFS and Lustre;
``open(O_EXCL)`` where links are not supported) and holding JSON that names its holder: host, PID, start time,
the boot of the host, the PID's own start time (so a recycled PID is not mistaken for the holder), a random token,
and a heartbeat that the holder rewrites every `HEARTBEAT_S` seconds. A second run reads it and

- fails at once when the holder is alive: same host (and boot) and the PID is the same process, or another host
  whose heartbeat advances (seen within one heartbeat);
- takes the lock over, with a log line, when the holder is gone: same host and the PID is dead or another process
  (kill -9), the host rebooted, or another host whose heartbeat has not moved for `STALE_AFTER_S` seconds (node
  loss; a heartbeat older than that by the holder's own clock counts at once).

The token is also the run's nonce: every rank reads it back to prove that all nodes see the same directory.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from txl_dist.fileio import atomic_write_text, ensure_directory
from txl_dist.supervision.processes import process_start

log = logging.getLogger("txl_dist.training")

LOCK_NAME = "run.lock"
HEARTBEAT_S = 5.0
"""Seconds between two rewrites of the lock by its holder."""
STALE_AFTER_S = 30.0
"""A lock held on another host whose heartbeat has not moved for this long belongs to a run that is gone."""


class RunDirectoryBusy(ValueError):
    """Another live run holds the output directory; the message names it."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return None


@dataclass
class LockHolder:
    host: str
    pid: int
    started: str
    """Local time the run started, ISO 8601."""
    token: str
    boot_id: str | None = None
    pid_start: int | None = None
    """The PID's start time, in clock ticks since boot (`txl_dist.supervision.processes.process_start`)."""
    heartbeat: int = 0
    heartbeat_unix: float = 0.0
    command: str = ""

    def describe(self) -> str:
        return f"host {self.host}, PID {self.pid}, started {self.started}"

    @classmethod
    def of_this_process(cls) -> LockHolder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            token=secrets.token_hex(16),
            boot_id=_boot_id(),
            pid_start=process_start(os.getpid()),
            heartbeat_unix=time.time(),
            command=" ".join(sys.argv)[:500],
        )


def read_holder(path: str | os.PathLike) -> LockHolder | None:
    """The holder recorded in a lock file; None when there is no file. A file that is not a lock raises
    ValueError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        return LockHolder(**{key: data[key] for key in LockHolder.__dataclass_fields__ if key in data})
    except (json.JSONDecodeError, TypeError) as error:
        raise ValueError(
            f"{path}: not a txl_dist run lock ({error}); if no run uses this directory, remove it"
        ) from None


class RunLock:
    """The lock of one output directory, held by one process (rank 0) from `acquire` to `release`."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        on_lost: Callable[[str], None] | None = None,
    ):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.holder = LockHolder.of_this_process()
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.on_lost = on_lost
        self._held = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    @property
    def token(self) -> str:
        return self.holder.token

    # ---- taking it ---------------------------------------------------------------------------------------------

    def acquire(self) -> RunLock:
        """Take the lock, taking over a stale one; raise `RunDirectoryBusy` when a live run holds it."""
        ensure_directory(self.directory)
        watched: LockHolder | None = None
        watched_since = 0.0
        while True:
            if self._create():
                break
            holder = read_holder(self.path)
            if holder is None:  # released between our attempt and the read
                continue
            verdict = self._liveness(holder)
            if verdict == "alive":
                raise self._busy(holder)
            if verdict is not None:
                log.warning("taking over %s from a run that is gone (%s): %s", self.path, holder.describe(), verdict)
                self._break(holder)
                continue
            # Another host: alive if its heartbeat moves.
            if watched is None or watched.token != holder.token:
                watched, watched_since = holder, time.monotonic()
                log.info(
                    "%s is held on another host (%s); watching its heartbeat for up to %.0f s",
                    self.path,
                    holder.describe(),
                    self.stale_after_s,
                )
            elif holder.heartbeat != watched.heartbeat:
                raise self._busy(holder)
            elif time.monotonic() - watched_since > self.stale_after_s:
                log.warning(
                    "taking over %s from a run that is gone (%s): its heartbeat has not moved for %.0f s",
                    self.path,
                    holder.describe(),
                    self.stale_after_s,
                )
                self._break(holder)
                watched = None
                continue
            time.sleep(min(0.5, self.heartbeat_s / 4))
        self._held = True
        self._thread = threading.Thread(target=self._beat, name="txl_dist-run-lock", daemon=True)
        self._thread.start()
        return self

    def _busy(self, holder: LockHolder) -> RunDirectoryBusy:
        return RunDirectoryBusy(
            f"{self.directory} is in use by another run ({holder.describe()}; lock {self.path}): one run per "
            f"train.output_dir. Wait for it to finish or stop it, or choose another train.output_dir"
        )

    def _liveness(self, holder: LockHolder) -> str | None:
        """ "alive"; the reason the holder is gone; or None when that cannot be told from here (another host)."""
        if holder.host != socket.gethostname():
            age = time.time() - holder.heartbeat_unix
            if holder.heartbeat_unix and age > self.stale_after_s * 2:  # twice: room for clocks that differ
                return f"its last heartbeat is {age:.0f} s old"
            return None
        if holder.boot_id and _boot_id() and holder.boot_id != _boot_id():
            return "the host has restarted since"
        start = process_start(holder.pid)
        if start is None:
            return f"PID {holder.pid} is no longer running"
        if holder.pid_start is not None and start != holder.pid_start:
            return f"PID {holder.pid} is another process now"
        return "alive"

    def _create(self) -> bool:
        """Create the lock file with our holder in it, atomically; False when it exists."""
        self.holder.heartbeat_unix = time.time()
        text = json.dumps(asdict(self.holder), indent=1) + "\n"
        staged = self.directory / f".{LOCK_NAME}.{self.holder.token}.tmp"
        atomic_write_text(staged, text)
        try:
            os.link(staged, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            # A filesystem without hard links: an exclusive create (atomic on NFSv3+ and Lustre), then the text.
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            return True
        finally:
            staged.unlink(missing_ok=True)

    def _break(self, stale: LockHolder) -> None:
        """Remove a stale lock; if another run took it over in the meantime, leave theirs in place."""
        aside = self.directory / f".{LOCK_NAME}.stale.{self.holder.token}"
        try:
            os.rename(self.path, aside)  # atomic: of two runs breaking the same lock, one moves it
        except FileNotFoundError:
            return
        try:
            moved = read_holder(aside)
        except ValueError:
            moved = None
        if moved is not None and moved.token != stale.token:
            try:  # we moved a fresh lock of a third run: put it back
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)

    # ---- holding it --------------------------------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat_s):
            lost = None
            with self._mutex:
                if not self._held:
                    return
                try:
                    current = read_holder(self.path)
                except (OSError, ValueError):
                    current = None
                if current is None or current.token != self.token:
                    self._held = False
                    lost = f"lost the run lock {self.path}: " + (
                        f"taken over by {current.describe()}" if current else "the file was removed"
                    )
                else:
                    self.holder.heartbeat += 1
                    self.holder.heartbeat_unix = time.time()
                    try:
                        atomic_write_text(self.path, json.dumps(asdict(self.holder), indent=1) + "\n")
                    except OSError as error:  # a full or failing disk: the run notices elsewhere
                        log.warning("could not refresh the heartbeat of %s: %s", self.path, error)
            if lost is not None:  # outside the mutex: the callback may end the process, releasing the lock
                log.error("%s", lost)
                if self.on_lost is not None:
                    self.on_lost(lost)
                return

    def release(self) -> None:
        """Remove the lock if it is still ours. Safe to call more than once and from any thread."""
        self._stopped.set()
        with self._mutex:
            if not self._held:
                return
            self._held = False
            try:
                current = read_holder(self.path)
                if current is not None and current.token == self.token:
                    self.path.unlink()
            except (OSError, ValueError) as error:
                log.warning("could not release %s: %s", self.path, error)
