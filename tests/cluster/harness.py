"""A real Slurm cluster on one machine, for the tests of the launch paths (issue 23): two nodes in the default
partition, and a third that only the spare partition adds (a job that keeps a spare node: TXL_SPARE_NODES).

Each node is a network namespace with its own address on a private subnet that exists only inside this machine,
connected by a veth pair to a bridge in the root namespace, plus a UTS namespace (its hostname), a mount namespace
(its /etc/hosts, /etc/slurm, ssh client config, /run and /dev/shm) and a PID namespace whose first process is
``node_init.py``; in it run the node's ``sshd`` (listening on the node's address) and ``slurmd -N NODE``. The root
namespace holds the bridge address, ``munged`` (own key and socket under the state directory) and ``slurmctld``.
The filesystem is shared by all, as a cluster's shared filesystem is.

Slurm is configured as most real clusters are: proctrack/cgroup, task/cgroup with memory and core constraints,
select/cons_tres with CR_Core_Memory, DefMemPerCPU (2 CPUs and 4000 MB per node, so 2000 MB per allocated CPU),
requeue allowed; times are short so that the tests are quick (measured here: a requeued job runs again ~12 s after
``scontrol requeue``; a killed node is DOWN ~28 s after ``kill_node`` and its job, NODE_FAIL, is requeued at ~30 s).
There is no accounting daemon; the end of every run of a job is kept in a jobcomp/filetxt log
(``Cluster.job_history``), so finished jobs stay visible after slurmctld forgets them (MinJobAge=60).

``Cluster`` is built in layers, each in a module of its own, lowest first: ``ClusterFiles`` (cluster_files.py: the
state directory, slurm.conf and the other configs, ssh keys), ``SlurmClient`` (slurm_client.py: scontrol, sbatch,
jobs and their states) and ``ClusterProcesses`` (processes.py: munged, slurmctld, each node's PID 1, commands run in
a node, the processes of a node or job); the network is network.py, what the machine must have host.py. This module
adds the cluster's start and stop (one cluster per machine: a lock and a file naming the cluster that is up) and the
faults a test makes (a node killed, cut off, restarted).

Use: ``cluster = Cluster.start(state_dir)`` ... ``cluster.stop()``; from a shell
``python -m tests.cluster.harness up|down|status [STATE_DIR]``. Needs root, ``ip netns``, ``unshare``, ``nsenter``
and the Debian packages in ``host.PACKAGES`` (``make cluster-packages`` installs them).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.cluster.cluster_files import STATE_MARKER
from tests.cluster.host import (
    START_TIMEOUT_S,
    ClusterError,
    ClusterUnavailable,
    check_machine,
    command_line,
    process_start_time,
    tail,
)
from tests.cluster.network import SUBNET, make_network, node_address, remove_network, set_link, subnet_in_use
from tests.cluster.processes import ClusterProcesses

DEFAULT_STATE_DIR = Path("/tmp/txl_cluster")
# One cluster per machine (its subnet, bridge and namespace names are fixed): this lock serialises start and stop,
# and this file names the state directory of the cluster that is up, so that a second harness finds it.
LOCK_FILE = Path("/tmp/txl_cluster.lock")
REGISTRY_FILE = Path("/tmp/txl_cluster.json")


class Cluster(ClusterProcesses):
    """A running two-node Slurm cluster (see the module docstring); made by ``Cluster.start``."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)
        self.start_seconds: float | None = None

    # ------------------------------------------------------------------ set-up and tear-down

    @classmethod
    def start(cls, state_dir: str | os.PathLike = DEFAULT_STATE_DIR, *, timeout: float = START_TIMEOUT_S) -> Cluster:
        """Brings the cluster up in STATE_DIR (made if missing) and returns it once both nodes are IDLE.

        Idempotent: leftovers of an earlier run in the same state directory (a crashed test session, ``up``) are
        stopped first. Refuses with ClusterUnavailable when the machine cannot host it, or when a cluster of
        another state directory is up. A part that does not come up within TIMEOUT raises ClusterError naming it
        and its log, after everything started so far has been stopped.
        """
        check_machine()
        cluster = cls(Path(state_dir))
        if (
            cluster.state_dir.is_dir()
            and any(cluster.state_dir.iterdir())
            and not (cluster.state_dir / STATE_MARKER).exists()
        ):
            raise ClusterUnavailable(f"{cluster.state_dir} is not empty and not a test cluster's state directory")
        began = time.monotonic()
        with cluster._locked():
            cluster._stop_previous()
            in_use = subnet_in_use()
            if in_use:
                raise ClusterUnavailable(f"the test subnet {SUBNET} is already routed on this machine: {in_use}")
            try:
                cluster._prepare_files()
                REGISTRY_FILE.write_text(
                    json.dumps(
                        {
                            "state_dir": str(cluster.state_dir),
                            "pid": os.getpid(),
                            "pid_start": process_start_time(os.getpid()),
                        }
                    )
                )
                make_network(cluster.all_nodes)
                cluster._start_munge(timeout)
                cluster._start_slurmctld(timeout)
                for node in cluster.all_nodes:
                    cluster._start_node(node)
                for node in cluster.all_nodes:
                    cluster._wait_node_up(node, since=0.0, timeout=timeout)
            except BaseException as error:
                if isinstance(error, ClusterError):
                    error.add_note(cluster.dump_logs(lines=15))  # shown by pytest and in tracebacks
                cluster._teardown()
                raise
        cluster.start_seconds = time.monotonic() - began
        return cluster

    def stop(self) -> None:
        """Stops every process the cluster started and removes its namespaces, veths and bridge.

        Safe to call twice and after a partial start; the state directory (configs, logs) is kept for reading.
        """
        with self._locked():
            self._teardown()

    @contextlib.contextmanager
    def _locked(self):
        """Holds the machine-wide harness lock, so that start and stop of two harnesses do not interleave."""
        with open(LOCK_FILE, "a+") as handle:
            deadline = time.monotonic() + 120.0
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ClusterError(f"{LOCK_FILE} stayed locked by another harness for 120 s") from None
                    time.sleep(0.5)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _stop_previous(self) -> None:
        """Stops a cluster left up by an earlier harness run, when it ran from this state directory.

        A cluster of another state directory whose processes still live is not ours to stop: refuse.
        """
        try:
            previous = json.loads(REGISTRY_FILE.read_text())
        except (OSError, ValueError):
            previous = None
        owner = previous.get("pid") if previous else None
        if owner and owner != os.getpid() and process_start_time(owner) == previous.get("pid_start"):
            # Another live process (a test session) started the cluster that is up, and may be using it now.
            raise ClusterUnavailable(
                f"the test cluster of {previous['state_dir']} is in use by process {owner} "
                f"({command_line(owner)}); wait for it, or stop it: python -m tests.cluster.harness down "
                f"{previous['state_dir']}"
            )
        if previous and Path(previous["state_dir"]).resolve() != self.state_dir:
            other = Cluster(Path(previous["state_dir"]))
            if other._live_pids():
                raise ClusterUnavailable(
                    f"a test cluster of state directory {other.state_dir} is up on this machine; stop it first: "
                    f"python -m tests.cluster.harness down {other.state_dir}"
                )
            other._teardown()
        self._teardown()

    def _teardown(self) -> None:
        """Kills the recorded processes (nodes first), removes namespaces, veths, bridge and cgroup leftovers."""
        order = [f"node-{node}" for node in self.all_nodes] + ["slurmctld", "munged"]
        for name in order:
            self._kill_recorded(name)
        for pid_file in sorted(self.pid_dir.glob("*.pid")) if self.pid_dir.is_dir() else []:
            self._kill_recorded(pid_file.stem)
        remove_network(self.all_nodes)
        self._remove_cgroups()
        try:
            if json.loads(REGISTRY_FILE.read_text()).get("state_dir") == str(self.state_dir):
                REGISTRY_FILE.unlink()
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ faults

    def kill_node(self, node: str) -> None:
        """Kills every process of NODE at once (slurmd, sshd, job steps and their ranks): SIGKILL to its PID 1.

        The node's network stays (its address answers with refusals, as a host whose daemons died); slurmctld
        marks it DOWN after SlurmdTimeout (20 s) without an answer.
        """
        self._kill_recorded(f"node-{node}")

    def disconnect_node(self, node: str) -> None:
        """Takes NODE's link to the bridge down (a dead NIC or cable): its processes run on, nothing reaches it."""
        set_link(node, "down")

    def reconnect_node(self, node: str) -> None:
        """Brings NODE's link to the bridge up again (after ``disconnect_node``)."""
        set_link(node, "up")

    def restart_node(self, node: str, timeout: float = START_TIMEOUT_S) -> None:
        """Starts a killed (or running: it is killed first) NODE again and waits until its new slurmd registered.

        With ReturnToService=2 a node that was DOWN for not responding becomes usable again by itself.
        """
        self._kill_recorded(f"node-{node}")
        since = time.time()
        self._start_node(node)
        self._wait_node_up(node, since=since, timeout=timeout)

    # ------------------------------------------------------------------ reading

    def address(self, node: str) -> str:
        """The node's address on the test subnet."""
        if node not in self.all_nodes:
            raise KeyError(f"no node {node!r} in the test cluster (nodes: {', '.join(self.all_nodes)})")
        return node_address(node)

    def logs(self) -> list[Path]:
        """The log files of the cluster: slurmctld, every slurmd, munged, sshd, node PID 1s."""
        return sorted(self.log_dir.glob("*.log")) + sorted(self.log_dir.glob("*.stdout"))

    def dump_logs(self, lines: int = 40) -> str:
        """The last LINES of each log of the cluster, each under a header with its path (for failing tests)."""
        parts = []
        for path in self.logs():
            if path.name == "jobcomp.txt":
                continue
            parts.append(f"==> {path} <==\n{tail(path, lines)}")
        parts.append(f"==> {self.jobcomp_log} <==\n{tail(self.jobcomp_log, lines)}")
        return "\n".join(parts)


def attach(state_dir: str | os.PathLike = DEFAULT_STATE_DIR) -> Cluster:
    """A Cluster object for a cluster brought up by another process (``up``) in STATE_DIR, to inspect or stop it."""
    cluster = Cluster(Path(state_dir))
    cluster._adopt_recorded()
    return cluster


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.cluster.harness up|down|status [STATE_DIR]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("up", "down", "status"):
        print("usage: python -m tests.cluster.harness up|down|status [STATE_DIR]", file=sys.stderr)
        return 2
    state_dir = Path(args[1]) if len(args) > 1 else DEFAULT_STATE_DIR
    try:
        if args[0] == "up":
            cluster = Cluster.start(state_dir)
            print(
                f"cluster up in {cluster.start_seconds:.1f} s: nodes "
                + ", ".join(f"{node} {cluster.address(node)}" for node in cluster.all_nodes)
            )
            print(
                f"export SLURM_CONF={cluster.slurm_conf} PDSH_RCMD_TYPE=ssh "
                f"PDSH_SSH_ARGS_APPEND='-F {cluster.ssh_config}'"
            )
            print(f"on a node: nsenter -t {cluster._init_pid(cluster.nodes[0])} -n -u -m -p bash")
        elif args[0] == "down":
            began = time.monotonic()
            attach(state_dir).stop()
            print(f"cluster of {state_dir} stopped in {time.monotonic() - began:.1f} s")
        else:
            print(attach(state_dir).status(), end="")
    except (ClusterUnavailable, ClusterError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
