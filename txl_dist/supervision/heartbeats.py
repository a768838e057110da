"""Liveness of the ranks: every rank's heartbeat in the rendezvous store, and the rank that stalled or died named.

Every rank's watch thread writes a heartbeat (a counter and the step it is on) into the rendezvous store of
torch.distributed every second, next to its identity (host, PID, start time). Rank 0 follows every rank's, the
others follow rank 0's. A rank whose heartbeat has not moved for ``stall_timeout`` seconds is frozen or cut off
(SIGSTOP, a hung host, a dead network link). That bound is meant to be well under the collective timeout
(``DEEPSPEED_TIMEOUT``, 10 minutes by default, after which gloo or NCCL would raise): a rank that is alive but
blocked inside one collective or kernel (its heartbeat moving) is left to that timeout. A rank that dies without a
word (SIGKILL, as the kernel's OOM killer sends, or a crash) is found by its process on this host (with its signal
while it is a zombie), or elsewhere by a heartbeat that stops moving.
"""

from __future__ import annotations

import os
import socket
import time

from txl_dist.supervision.processes import how_it_ended, process_start

STORE_PREFIX = f"txl_dist/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
"""Of this run's keys in the rendezvous store. torchrun's agent keeps its store across the restarts of a job's
workers: the keys are per attempt."""
HEARTBEAT_KEY = STORE_PREFIX + "heartbeat/{rank}"
HEARTBEAT_EVERY = 4
"""A rank writes its heartbeat every this many periods of its watch thread
(`txl_dist.supervision.launcher_watch.WATCH_S`, a quarter of a second): once a second."""
STALL_CHECK_EVERY = 8
"""A rank looks at the heartbeats it follows every this many watch periods: every two seconds. A stall is found
between ``train.stall_timeout`` and that plus two seconds after the heartbeat stopped."""
IDENTITY_KEY = STORE_PREFIX + "identity/{rank}"


class Heartbeats:
    """This rank's heartbeat and what it knows of the others', through ``store`` (a torch.distributed Store)."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self._beats = 0
        self._identities: dict[int, tuple[str, int, int]] = {}
        self._peer_beats: dict[int, tuple[bytes | None, float]] = {}

    def join(self, step: int) -> None:
        """Publish this rank's identity and its first heartbeat."""
        identity = f"{socket.gethostname()} {os.getpid()} {process_start(os.getpid())}"
        self.store.set(IDENTITY_KEY.format(rank=self.rank), identity)
        self.beat(step)

    def beat(self, step: int) -> None:
        self._beats += 1
        self.store.set(HEARTBEAT_KEY.format(rank=self.rank), f"{self._beats} {step}")

    def _watched_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]

    def _identity(self, rank: int) -> tuple[str, int, int] | None:
        """(host, PID, start time) of ``rank``, read once from the store and kept (rank 0's store may go)."""
        if rank not in self._identities:
            try:
                if self.store.check([IDENTITY_KEY.format(rank=rank)]):
                    host, pid, start = self.store.get(IDENTITY_KEY.format(rank=rank)).decode().split(" ")
                    self._identities[rank] = (host, int(pid), int(start))
            except Exception:
                return None
        return self._identities.get(rank)

    def who(self, rank: int) -> str:
        identity = self._identity(rank)
        return f"rank {rank} ({identity[0]}, PID {identity[1]})" if identity else f"rank {rank}"

    def host_of(self, rank: int) -> str | None:
        """The host of ``rank`` as it published it (None before it did, or once the store is gone unread)."""
        identity = self._identity(rank)
        return identity[0] if identity else None

    def step_of(self, rank: int) -> str:
        """The step in ``rank``'s last heartbeat seen here; ``?`` before the first."""
        beat = self._peer_beats.get(rank, (None, 0.0))[0]
        return beat.decode().split(" ")[1] if beat else "?"

    def stalled(self, now: float, stall_timeout: float) -> tuple[int, float] | None:
        """The first watched rank whose heartbeat has not moved for ``stall_timeout`` seconds, and for how long."""
        ranks = self._watched_ranks()
        keys = [HEARTBEAT_KEY.format(rank=r) for r in ranks]
        if len(self._peer_beats) < len(ranks) and not self.store.check(keys):
            return None  # not every rank has joined yet (a get would wait for the missing one)
        for rank in ranks:
            self._identity(rank)
        for rank, value in zip(ranks, self.store.multi_get(keys)):
            previous = self._peer_beats.get(rank)
            if previous is None or previous[0] != value:
                self._peer_beats[rank] = (value, now)
            elif now - previous[1] > stall_timeout:
                return rank, now - previous[1]
        return None

    def dead_peers(self, wait_s: float) -> list[tuple[int, str]]:
        """Ranks that are gone, with how they went where it can be read: peers on this host by their process,
        the others by a heartbeat that stops moving within ``wait_s``."""
        dead: list[tuple[int, str]] = []
        here = socket.gethostname()
        remote = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            identity = self._identity(rank)
            if identity and identity[0] == here:
                how = how_it_ended(identity[1], identity[2])
                if how is not None:
                    dead.append((rank, how))
            else:
                remote.append(rank)
        if remote and not dead:
            dead += self._silent(remote, wait_s)
        return dead

    def _silent(self, remote: list[int], wait_s: float) -> list[tuple[int, str]]:
        """Those of ``remote`` whose heartbeat does not move within ``wait_s``; rank 0 when its store is gone."""
        keys = [HEARTBEAT_KEY.format(rank=r) for r in remote]
        deadline = time.monotonic() + wait_s
        try:
            first = dict(zip(remote, self.store.multi_get(keys)))
            moved: set[int] = set()
            while time.monotonic() < deadline and len(moved) < len(remote):
                time.sleep(0.5)
                moved |= {r for r, value in zip(remote, self.store.multi_get(keys)) if value != first[r]}
            return [(r, "") for r in remote if r not in moved]
        except Exception:  # rank 0, and its store, are gone
            return [(0, "")] if self.rank != 0 else []
