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

Use: ``cluster = Cluster.start(state_dir)`` ... ``cluster.stop()``; from a shell
``python -m tests.cluster.harness up|down|status [STATE_DIR]``. Needs root, ``ip netns``, ``unshare``, ``nsenter``
and the Debian packages in ``PACKAGES`` (``make cluster-packages`` installs them).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Debian packages the cluster needs (``make cluster-packages`` installs the missing ones).
PACKAGES = (
    "slurm-wlm",
    "munge",
    "openssh-server",
    "openssh-client",
    "pdsh",
    "iproute2",
    "util-linux",
    "procps",
    "openmpi-bin",
)
# Commands the harness itself runs, checked before anything is set up.
REQUIRED_COMMANDS = (
    "ip",
    "unshare",
    "nsenter",
    "mount",
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "squeue",
    "sshd",
    "ssh",
    "ssh-keygen",
    "pdsh",
)

SUBNET = ipaddress.ip_network("10.231.87.0/24")
CONTROLLER_ADDRESS = "10.231.87.1"
NODE_NAMES = ("txlnode1", "txlnode2", "txlnode3")
TRAINING_NODES = 2
"""The nodes of the default partition (`Cluster.nodes`): where every job goes unless it names another partition.
The third node is only in `SPARE_PARTITION`, for the jobs that keep a spare node (TXL_SPARE_NODES)."""
NODE_CPUS = 2
NODE_MEMORY_MB = 4000
PARTITION = "txl"
SPARE_PARTITION = "txlspare"
"""A partition of all three nodes (`Cluster.all_nodes`): two that train and one kept as a spare."""
BRIDGE = "txlbr0"
SLURMCTLD_PORT = 16817
SLURMD_PORT = 16818
SLURMD_TIMEOUT_S = 20
DEFAULT_STATE_DIR = Path("/tmp/txl_cluster")
# One cluster per machine (its subnet, bridge and namespace names are fixed): this lock serialises start and stop,
# and this file names the state directory of the cluster that is up, so that a second harness finds it.
LOCK_FILE = Path("/tmp/txl_cluster.lock")
REGISTRY_FILE = Path("/tmp/txl_cluster.json")
STATE_MARKER = ".txl_cluster_state"

NODE_INIT = Path(__file__).with_name("node_init.py")
# Every wait in the harness ends after at most this long (seconds) unless the caller gives another.
START_TIMEOUT_S = 60.0
# Job states after which a job does not run again by itself (a requeued job goes PENDING, not one of these).
FINISHED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the cluster (not root, no namespaces, a missing tool, the subnet in use)."""


class ClusterError(RuntimeError):
    """A part of the cluster did not come up or did not respond in time; the message names it and its log."""


def namespace_name(node: str) -> str:
    """The ``ip netns`` name of a node."""
    return f"txl-{node}"


def host_veth(node: str) -> str:
    """The root-namespace end of a node's veth pair (at most 15 characters, the kernel's limit)."""
    return f"txlv-{node}"[:15]


def node_address(node: str) -> str:
    """The node's address on the test subnet: .11 for the first node, .12 for the second, ..."""
    return str(SUBNET.network_address + 11 + NODE_NAMES.index(node))


def _with_sbin(env: Mapping[str, str]) -> dict[str, str]:
    """ENV with /usr/sbin and /sbin on PATH (the daemons and `ip` live there; a CI shell may not have them)."""
    env = dict(env)
    parts = env.get("PATH", os.defpath).split(os.pathsep)
    env["PATH"] = os.pathsep.join(parts + [part for part in ("/usr/sbin", "/sbin") if part not in parts])
    return env


def _run(
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Runs a command of the harness, capturing its output; a failure raises with the command and its stderr."""
    try:
        result = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_with_sbin(os.environ if env is None else env),
            input=input,
        )
    except subprocess.TimeoutExpired as error:
        raise ClusterError(f"{shlex.join(argv)} did not finish within {timeout:.0f} s") from error
    if check and result.returncode != 0:
        last_line = ((result.stderr or result.stdout).strip().splitlines() or [""])[-1]
        raise ClusterError(f"{shlex.join(argv)} failed (exit {result.returncode}): {last_line}")
    return result


def _process_start_time(pid: int) -> str | None:
    """The start time of a live process (field 22 of /proc/PID/stat); None when there is none, or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _command_line(pid: int) -> str:
    """The command line of a process, shortened, or '?'."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
        return " ".join(words)[:120]
    except OSError:
        return "?"


def _tail(path: Path, lines: int) -> str:
    """The last lines of a text file, or a line saying it does not exist."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} does not exist)\n"
    return "".join(text.splitlines(keepends=True)[-lines:])


def _own_cgroups_v1() -> dict[str, str]:
    """Mount point -> this process's cgroup path, for each cgroup v1 hierarchy mounted under /sys/fs/cgroup."""
    by_controllers: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers:
            by_controllers[controllers] = path
    result = {}
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount_point, fstype, options = line.split()[:4]
        if fstype != "cgroup" or not mount_point.startswith("/sys/fs/cgroup/"):
            continue
        for controllers, path in by_controllers.items():
            wanted = set(controllers.split(","))
            if wanted <= set(options.split(",")) | {o.removeprefix("name=") for o in options.split(",")}:
                result[mount_point] = path
                break
    return result


def cgroup_v1_available() -> bool:
    """Whether the memory, cpuset and freezer controllers are mounted as cgroup v1 hierarchies."""
    return all(Path(f"/sys/fs/cgroup/{name}/tasks").exists() for name in ("memory", "cpuset", "freezer"))


def check_machine() -> None:
    """Raises ClusterUnavailable with one line when this machine cannot host the cluster."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("the test cluster needs root (network, UTS, mount and PID namespaces, slurmd)")
    search_path = _with_sbin(os.environ)["PATH"]
    missing = [name for name in REQUIRED_COMMANDS if shutil.which(name, path=search_path) is None]
    if missing:
        raise ClusterUnavailable(
            f"missing commands for the test cluster: {' '.join(missing)} (run `make cluster-packages` as root)"
        )
    if not cgroup_v1_available():
        raise ClusterUnavailable(
            "the test cluster needs cgroup v1 hierarchies memory, cpuset and freezer "
            "under /sys/fs/cgroup (proctrack/cgroup with cgroup/v1)"
        )
    probe = subprocess.run(
        ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise ClusterUnavailable(f"namespaces are not allowed here: unshare failed: {probe.stderr.strip()}")


def subnet_in_use() -> str | None:
    """A line naming a route or address of this machine inside (or around) the test subnet, or None."""
    for family_args in (["-4", "route", "show", "table", "all"], ["-4", "-o", "addr", "show"]):
        out = _run(["ip", *family_args], check=False).stdout
        for line in out.splitlines():
            fields = line.split()
            candidates = fields[:1] if family_args[1] == "route" else fields[3:4]
            for candidate in candidates:
                if candidate in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
                    candidate = fields[1] if len(fields) > 1 else ""
                try:
                    network = ipaddress.ip_network(candidate, strict=False)
                except ValueError:
                    continue
                if network.prefixlen > 0 and network.overlaps(SUBNET):
                    return line.strip()
    return None


@dataclass
class _Daemon:
    """A process the harness started (root side), with its pid file and log."""

    name: str
    process: subprocess.Popen | None
    pid: int
    log: Path


class Cluster:
    """A running two-node Slurm cluster (see the module docstring); made by ``Cluster.start``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.all_nodes: tuple[str, ...] = NODE_NAMES
        self.nodes: tuple[str, ...] = NODE_NAMES[:TRAINING_NODES]
        """The nodes of the default partition; `all_nodes` adds the third, in `spare_partition` only."""
        self.partition = PARTITION
        self.spare_partition = SPARE_PARTITION
        self.controller_address = CONTROLLER_ADDRESS
        self.etc_dir = self.state_dir / "etc"
        self.log_dir = self.state_dir / "log"
        self.pid_dir = self.state_dir / "pids"
        self.ssh_dir = self.state_dir / "ssh"
        self.munge_dir = self.state_dir / "munge"
        self.slurm_conf = self.etc_dir / "slurm.conf"
        self.ssh_config = self.ssh_dir / "ssh_config"
        self.jobcomp_log = self.log_dir / "jobcomp.txt"
        self.shared_dir = self.state_dir / "shared"
        self.bin_dir = self.ssh_dir / "bin"
        self._daemons: dict[str, _Daemon] = {}
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
                            "pid_start": _process_start_time(os.getpid()),
                        }
                    )
                )
                cluster._make_network()
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
        if owner and owner != os.getpid() and _process_start_time(owner) == previous.get("pid_start"):
            # Another live process (a test session) started the cluster that is up, and may be using it now.
            raise ClusterUnavailable(
                f"the test cluster of {previous['state_dir']} is in use by process {owner} "
                f"({_command_line(owner)}); wait for it, or stop it: python -m tests.cluster.harness down "
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

    def _live_pids(self) -> list[int]:
        """The pids of this state directory's pid files whose processes are still the ones recorded."""
        live = []
        for pid_file in sorted(self.pid_dir.glob("*.pid")) if self.pid_dir.is_dir() else []:
            try:
                pid_text, start_time = pid_file.read_text().split()
                pid = int(pid_text)
            except (OSError, ValueError):
                continue
            if _process_start_time(pid) == start_time:
                live.append(pid)
        return live

    def _teardown(self) -> None:
        """Kills the recorded processes (nodes first), removes namespaces, veths, bridge and cgroup leftovers."""
        order = [f"node-{node}" for node in self.all_nodes] + ["slurmctld", "munged"]
        for name in order:
            self._kill_recorded(name)
        for pid_file in sorted(self.pid_dir.glob("*.pid")) if self.pid_dir.is_dir() else []:
            self._kill_recorded(pid_file.stem)
        for node in self.all_nodes:
            _run(["ip", "link", "del", host_veth(node)], check=False)
            _run(["ip", "netns", "del", namespace_name(node)], check=False)
        _run(["ip", "link", "del", BRIDGE], check=False)
        self._remove_cgroups()
        try:
            if json.loads(REGISTRY_FILE.read_text()).get("state_dir") == str(self.state_dir):
                REGISTRY_FILE.unlink()
        except (OSError, ValueError):
            pass

    def _kill_recorded(self, name: str) -> None:
        """SIGKILLs the process of pid file NAME if it is still the one recorded, waits for it, removes the file."""
        pid_file = self.pid_dir / f"{name}.pid"
        daemon = self._daemons.pop(name, None)
        try:
            pid_text, start_time = pid_file.read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            pid, start_time = None, None
        if pid is not None and _process_start_time(pid) == start_time:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if daemon is not None and daemon.process is not None:
            try:
                daemon.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10.0
        while pid is not None and _process_start_time(pid) == start_time and time.monotonic() < deadline:
            time.sleep(0.05)
        # A node's PID 1 is the child of `unshare`; the kernel has killed the rest of its namespace with it.
        pid_file.unlink(missing_ok=True)

    def _remove_cgroups(self) -> None:
        """Removes the (empty) cgroup directories slurmd made for the nodes, deepest first."""
        try:  # the cgroups the nodes were nested in when they started (a later `down` may run elsewhere)
            cgroups = json.loads((self.state_dir / "cgroups.json").read_text())
        except (OSError, ValueError):
            cgroups = _own_cgroups_v1()
        for mount_point, relative in cgroups.items():
            base = Path(mount_point + (relative if relative != "/" else ""))
            for node in self.all_nodes:
                top = base / f"slurm_{node}"
                if not top.is_dir():
                    continue
                for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    try:
                        directory.rmdir()
                    except OSError:
                        pass
                try:
                    top.rmdir()
                except OSError:
                    pass

    def _record(self, name: str, process: subprocess.Popen, pid: int, log: Path) -> None:
        """Writes the pid file of a started process (pid and start time, so a reused pid is never killed)."""
        start_time = _process_start_time(pid)
        (self.pid_dir / f"{name}.pid").write_text(f"{pid} {start_time}\n")
        self._daemons[name] = _Daemon(name, process, pid, log)

    # ------------------------------------------------------------------ files

    def _prepare_files(self) -> None:
        """Writes munge key, slurm.conf, cgroup.conf, hosts file, ssh keys and configs into the state directory."""
        # Fresh logs for each start; the previous start's are kept beside them (a crashed session's, for reading).
        if self.log_dir.is_dir():
            shutil.rmtree(self.state_dir / "log.previous", ignore_errors=True)
            self.log_dir.rename(self.state_dir / "log.previous")
        for directory in (
            self.state_dir,
            self.etc_dir,
            self.log_dir,
            self.pid_dir,
            self.ssh_dir,
            self.munge_dir,
            self.shared_dir,
            self.state_dir / "ctld",
            self.state_dir / "spool",
        ):
            directory.mkdir(parents=True, exist_ok=True)
        (self.state_dir / STATE_MARKER).touch()
        os.chmod(self.state_dir, 0o755)
        os.chmod(self.shared_dir, 0o1777)
        # Fresh controller state each start: no jobs or node states from an earlier run.
        shutil.rmtree(self.state_dir / "ctld")
        (self.state_dir / "ctld").mkdir()
        for node in self.all_nodes:
            shutil.rmtree(self.state_dir / "spool" / node, ignore_errors=True)
            (self.state_dir / "spool" / node).mkdir()
            (self.state_dir / "nodes" / node).mkdir(parents=True, exist_ok=True)
        self.jobcomp_log.unlink(missing_ok=True)
        (self.state_dir / "cgroups.json").write_text(json.dumps(_own_cgroups_v1()))

        os.chmod(self.munge_dir, 0o755)  # munged wants its socket's directory searchable
        key = self.munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)

        hosts = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{CONTROLLER_ADDRESS}\ttxlctl"]
        hosts += [f"{node_address(node)}\t{node}" for node in self.all_nodes]
        (self.etc_dir / "hosts").write_text("\n".join(hosts) + "\n")
        (self.etc_dir / "slurm.conf").write_text(self._slurm_conf())
        (self.etc_dir / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\n"
            "CgroupAutomount=no\n"
            "ConstrainCores=yes\n"
            "ConstrainRAMSpace=yes\n"
            "ConstrainSwapSpace=no\n"
            "ConstrainDevices=no\n"
        )
        # An empty plugstack: Debian's /etc/slurm/plugstack.conf is not read through our SLURM_CONF directory.
        (self.etc_dir / "plugstack.conf").write_text("")

        client_key = self.ssh_dir / "id_ed25519"
        if not client_key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "txl-cluster", "-f", str(client_key)])
        (self.ssh_dir / "authorized_keys").write_text(Path(f"{client_key}.pub").read_text())
        known_hosts = []
        for node in self.all_nodes:
            node_dir = self.state_dir / "nodes" / node
            host_key = node_dir / "ssh_host_ed25519_key"
            if not host_key.exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", node, "-f", str(host_key)])
            public = Path(f"{host_key}.pub").read_text().split()
            known_hosts.append(f"{node},{node_address(node)} {public[0]} {public[1]}")
            (node_dir / "sshd_config").write_text(
                f"ListenAddress {node_address(node)}\n"
                "Port 22\n"
                f"HostKey {host_key}\n"
                f"PidFile {node_dir / 'sshd.pid'}\n"
                f"AuthorizedKeysFile {self.ssh_dir / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "UseDNS no\n"
                "PrintMotd no\n"
                "AcceptEnv LANG LC_*\n"
                "MaxStartups 100:30:200\n"
                "Subsystem sftp internal-sftp\n"
            )
        (self.ssh_dir / "known_hosts").write_text("\n".join(known_hosts) + "\n")
        # `ssh` for the root namespace (first on PATH in ssh_env()): the harness's config, so that tools that run
        # plain `ssh HOST` (deepspeed's ssh check and `hostname -I` probe, mpirun's rsh agent) reach the nodes.
        self.bin_dir.mkdir(exist_ok=True)
        wrapper = self.bin_dir / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh") or "/usr/bin/ssh"} -F {self.ssh_config} "$@"\n')
        os.chmod(wrapper, 0o755)
        host_blocks = "".join(f"Host {node}\n    HostName {node_address(node)}\n" for node in self.all_nodes)
        self.ssh_config.write_text(
            host_blocks + "Host *\n"
            "    User root\n"
            f"    IdentityFile {client_key}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {self.ssh_dir / 'known_hosts'}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    CheckHostIP no\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 5\n"
            "    LogLevel ERROR\n"
        )

    def _slurm_conf(self, slurmd_timeout: int = SLURMD_TIMEOUT_S) -> str:
        """The cluster's slurm.conf."""
        state = self.state_dir
        node_lines = "".join(
            f"NodeName={node} NodeAddr={node_address(node)} NodeHostname={node} CPUs={NODE_CPUS} Boards=1 "
            f"SocketsPerBoard=1 CoresPerSocket={NODE_CPUS} ThreadsPerCore=1 RealMemory={NODE_MEMORY_MB} "
            "State=UNKNOWN\n"
            for node in self.all_nodes
        )
        controller = socket.gethostname().split(".")[0]
        return (
            "# Written by tests/cluster/harness.py: a two-node test cluster on one machine.\n"
            "ClusterName=txltest\n"
            f"SlurmctldHost={controller}({CONTROLLER_ADDRESS})\n"
            f"SlurmctldPort={SLURMCTLD_PORT}\n"
            f"SlurmdPort={SLURMD_PORT}\n"
            "SlurmUser=root\n"
            "SlurmdUser=root\n"
            "AuthType=auth/munge\n"
            "CredType=cred/munge\n"
            # cred_expire=10: a requeued job may start again ~11 s after it ended (default 120 s).
            f"AuthInfo=cred_expire=10,socket={self.munge_dir / 'munge.socket'}\n"
            f"StateSaveLocation={state / 'ctld'}\n"
            f"SlurmdSpoolDir={state / 'spool' / '%n'}\n"
            f"SlurmctldPidFile={state / 'run-slurmctld.pid'}\n"
            f"SlurmdPidFile={state / 'spool' / '%n' / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}\n"
            f"SlurmdLogFile={self.log_dir / 'slurmd-%n.log'}\n"
            f"PlugStackConfig={self.etc_dir / 'plugstack.conf'}\n"
            "SlurmctldDebug=info\n"
            "SlurmdDebug=info\n"
            "ProctrackType=proctrack/cgroup\n"
            "TaskPlugin=task/cgroup,task/affinity\n"
            "SelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core_Memory\n"
            "SchedulerType=sched/backfill\n"
            # sched_interval=5: the main scheduler looks at pending (e.g. requeued) jobs every 5 s.
            "SchedulerParameters=sched_interval=5\n"
            "SlurmdParameters=config_overrides\n"
            "MpiDefault=none\n"
            # A default memory per CPU, as most clusters set: a job gets 2000 MB per allocated CPU, and a step
            # asks for its CPUs times that (SLURM_MEM_PER_CPU is exported into the batch script).
            f"DefMemPerCPU={NODE_MEMORY_MB // NODE_CPUS}\n"
            "JobRequeue=1\n"
            "ReturnToService=2\n"
            "KillWait=10\n"
            "MinJobAge=60\n"
            f"SlurmdTimeout={slurmd_timeout}\n"
            "SlurmctldTimeout=30\n"
            "InactiveLimit=0\n"
            "MessageTimeout=10\n"
            "Waittime=0\n"
            "AccountingStorageType=accounting_storage/none\n"
            "JobAcctGatherType=jobacct_gather/none\n"
            "JobCompType=jobcomp/filetxt\n"
            f"JobCompLoc={self.jobcomp_log}\n"
            + node_lines
            + f"PartitionName={PARTITION} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP\n"
            + f"PartitionName={SPARE_PARTITION} Nodes={','.join(self.all_nodes)} MaxTime=INFINITE State=UP\n"
        )

    # ------------------------------------------------------------------ processes

    def _make_network(self) -> None:
        """The bridge with the controller address, and per node a netns with a veth to the bridge."""
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{CONTROLLER_ADDRESS}/{SUBNET.prefixlen}", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for node in self.all_nodes:
            netns = namespace_name(node)
            _run(["ip", "netns", "add", netns])
            _run(["ip", "link", "add", host_veth(node), "type", "veth", "peer", "name", "eth0", "netns", netns])
            _run(["ip", "link", "set", host_veth(node), "master", BRIDGE])
            _run(["ip", "link", "set", host_veth(node), "up"])
            _run(["ip", "-n", netns, "addr", "add", f"{node_address(node)}/{SUBNET.prefixlen}", "dev", "eth0"])
            _run(["ip", "-n", netns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", netns, "link", "set", "lo", "up"])

    def _spawn(self, name: str, argv: Sequence[str], log: Path) -> subprocess.Popen:
        """Starts a root-side daemon in the foreground (its own session), output appended to LOG."""
        with open(log, "ab") as out:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env(),
            )
        self._record(name, process, process.pid, log)
        return process

    def _wait(self, what: str, ready, log: Path, timeout: float, process: subprocess.Popen | None = None) -> None:
        """Polls READY() until true; raises ClusterError naming WHAT and LOG on timeout or when PROCESS exits."""
        deadline = time.monotonic() + timeout
        while True:
            if ready():
                return
            if process is not None and process.poll() is not None:
                raise ClusterError(f"{what} exited with {process.returncode} while starting; log: {log}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} did not come up within {timeout:.0f} s; log: {log}")
            time.sleep(0.2)

    def _start_munge(self, timeout: float) -> None:
        """munged with its own key, socket, pid and seed files under the state directory."""
        log = self.log_dir / "munged.log"
        socket_path = self.munge_dir / "munge.socket"
        process = self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={socket_path}",
                f"--key-file={self.munge_dir / 'munge.key'}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--log-file={log}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
                "--num-threads=10",
            ],
            log,
        )

        def works() -> bool:
            credential = subprocess.run(["munge", "-n", "-S", str(socket_path)], capture_output=True, timeout=10)
            return (
                credential.returncode == 0
                and subprocess.run(
                    ["unmunge", "-S", str(socket_path)], input=credential.stdout, capture_output=True, timeout=10
                ).returncode
                == 0
            )

        self._wait("munged", works, log, timeout, process)

    def _start_slurmctld(self, timeout: float) -> None:
        """slurmctld in the root namespace, in the foreground, with a clean state."""
        log = self.log_dir / "slurmctld.log"
        process = self._spawn(
            "slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.slurm_conf)], self.log_dir / "slurmctld.stdout"
        )

        def answers() -> bool:
            result = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=self.env(), timeout=15)
            return "is UP" in result.stdout

        self._wait("slurmctld", answers, log, timeout, process)

    def _start_node(self, node: str) -> None:
        """Starts a node: its PID 1 (node_init.py) in the node's netns and new UTS, mount and PID namespaces."""
        node_dir = self.state_dir / "nodes" / node
        ready_file = node_dir / "ready"
        ready_file.unlink(missing_ok=True)
        spec = {
            "name": node,
            "hosts_file": str(self.etc_dir / "hosts"),
            "slurm_etc": str(self.etc_dir),
            "ssh_config": str(self.ssh_config),
            "cgroups": json.loads((self.state_dir / "cgroups.json").read_text()),
            "ready_file": str(ready_file),
            "sshd_argv": [
                shutil.which("sshd", path=self.env()["PATH"]) or "/usr/sbin/sshd",
                "-D",
                "-e",
                "-f",
                str(node_dir / "sshd_config"),
            ],
            "sshd_log": str(self.log_dir / f"sshd-{node}.log"),
            "slurmd_argv": ["slurmd", "-D", "-N", node, "-f", str(self.slurm_conf)],
            "slurmd_stdout": str(self.log_dir / f"slurmd-{node}.stdout"),
        }
        log = self.log_dir / f"node-{node}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{namespace_name(node)}",
                    "--",
                    "unshare",
                    "--uts",
                    "--mount",
                    "--pid",
                    "--fork",
                    "--mount-proc",
                    "--",
                    sys.executable,
                    str(NODE_INIT),
                    json.dumps(spec),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env(),
            )
        # The node's PID 1 is the child of `unshare` (which stays as its parent and waits for it).
        deadline = time.monotonic() + 10.0
        init_pid = None
        while init_pid is None:
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
            try:
                pids = children.read_text().split()
            except OSError:
                pids = []
            if pids:
                init_pid = int(pids[0])
            elif process.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"node {node} did not start (exit {process.poll()}); log: {log}")
            else:
                time.sleep(0.02)
        self._record(f"node-{node}", process, init_pid, log)
        self._wait(f"node {node} (node_init.py)", ready_file.exists, log, 20.0, process)

    def _init_pid(self, node: str) -> int:
        """The root-namespace pid of the node's PID 1; ClusterError when the node is not running."""
        daemon = self._daemons.get(f"node-{node}")
        if daemon is None or _process_start_time(daemon.pid) is None:
            raise ClusterError(f"node {node} is not running (killed, or not started)")
        return daemon.pid

    def node_info(self, node: str) -> dict[str, str]:
        """``scontrol show node NODE`` as a dict (State, Reason, SlurmdStartTime, ...)."""
        return _parse_scontrol(self.scontrol("show", "node", "-o", node).stdout)

    def _wait_node_up(self, node: str, since: float, timeout: float) -> None:
        """Waits until NODE's sshd accepts connections and its slurmd (started after SINCE, epoch s) has registered."""
        log = self.log_dir / f"slurmd-{node}.log"

        def sshd_up() -> bool:
            try:
                with socket.create_connection((node_address(node), 22), timeout=1.0):
                    return True
            except OSError:
                return False

        self._wait(f"sshd of {node} ({node_address(node)}:22)", sshd_up, self.log_dir / f"sshd-{node}.log", timeout)

        def registered() -> bool:
            info = self.node_info(node)
            if self._unusable(info.get("State", "*")):
                return False
            started = info.get("SlurmdStartTime", "None")
            if since and started not in ("None", ""):
                if time.mktime(time.strptime(started, "%Y-%m-%dT%H:%M:%S")) < since - 1:
                    return False
            return True

        self._wait(f"slurmd of {node}", registered, log, timeout)

    # ------------------------------------------------------------------ public API

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm commands in the root namespace: os.environ + SLURM_CONF (+ EXTRA)."""
        env = _with_sbin(os.environ)
        env["SLURM_CONF"] = str(self.slurm_conf)
        env.update(extra or {})
        return env

    def ssh_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment in which ssh, ``pdsh -w txlnode1,txlnode2``, deepspeed and mpirun reach the nodes.

        ``env()`` plus PDSH_RCMD_TYPE=ssh, PDSH_SSH_ARGS_APPEND=``-F <state>/ssh/ssh_config`` (node names ->
        addresses, the harness's key and known_hosts, no prompts) and, first on PATH, an ``ssh`` that reads the
        same file (for tools that run plain ``ssh HOST``). Root's ~/.ssh is not touched. Inside the nodes that
        file is /etc/ssh/ssh_config, so there ``ssh txlnode2`` and pdsh work without any of this.
        """
        env = self.env({"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {self.ssh_config}"})
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        env.update(extra or {})
        return env

    def address(self, node: str) -> str:
        """The node's address on the test subnet."""
        if node not in self.all_nodes:
            raise KeyError(f"no node {node!r} in the test cluster (nodes: {', '.join(self.all_nodes)})")
        return node_address(node)

    def _node_argv(self, node: str, argv: Sequence[str], cwd: str | os.PathLike | None) -> list[str]:
        """``nsenter`` into every namespace of NODE (net, UTS, mount, PID), in CWD, then ARGV."""
        directory = os.path.abspath(cwd if cwd is not None else os.getcwd())
        return [
            "nsenter",
            "-t",
            str(self._init_pid(node)),
            "--net",
            "--uts",
            "--mount",
            "--pid",
            f"--wd={directory}",
            "--",
            *argv,
        ]

    def popen_on(
        self,
        node: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        **popen_kwargs,
    ) -> subprocess.Popen:
        """Starts ARGV on NODE (as ``run_on``) without waiting; the process dies with the node (kill_node)."""
        return subprocess.Popen(
            self._node_argv(node, argv, cwd), env=self.env(env), start_new_session=True, **popen_kwargs
        )

    def run_on(
        self,
        node: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        timeout: float = 60.0,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Runs ARGV inside NODE's namespaces as a job step sees the node (its hostname, network, /etc/hosts).

        ENV is added to os.environ + SLURM_CONF; output is captured as text. On TIMEOUT the command's whole
        process group is killed and subprocess.TimeoutExpired raised; CHECK raises CalledProcessError on a
        non-zero exit.
        """
        process = self.popen_on(node, argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
        result = subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr)
        if check:
            result.check_returncode()
        return result

    def scontrol(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Runs ``scontrol ARGS`` against this cluster."""
        return _run(["scontrol", *args], check=check, timeout=timeout, env=self.env())

    def sbatch(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        timeout: float = 30.0,
    ) -> int:
        """Submits a batch job from the root namespace (``sbatch --parsable ARGS``) and returns its job id."""
        command = ["sbatch", "--parsable", *args]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, env=self.env(env), cwd=cwd, timeout=timeout
            )
        except subprocess.TimeoutExpired as error:
            raise ClusterError(
                f"{shlex.join(command)} did not answer within {timeout:.0f} s; log: {self.log_dir / 'slurmctld.log'}"
            ) from error
        if result.returncode != 0:
            raise ClusterError(f"sbatch refused the job: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str] | None:
        """``scontrol show job JOB_ID`` as a dict, or None when the controller no longer knows the job."""
        result = self.scontrol("show", "job", "-o", str(job_id), check=False)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise ClusterError(f"scontrol show job {job_id} failed: {result.stderr.strip()}")
        return _parse_scontrol(result.stdout.splitlines()[0])

    def job_history(self, job_id: int) -> list[dict[str, str]]:
        """Every end of a run of JOB_ID recorded by jobcomp/filetxt, oldest first, as dicts (JobState, ExitCode, ...).

        A requeued job has one record per run: JobState=PENDING for a run ended by ``scontrol requeue``,
        NODE_FAIL for one ended by a lost node, then the final state of the last run.
        """
        try:
            lines = self.jobcomp_log.read_text().splitlines()
        except OSError:
            return []
        records = [_parse_scontrol(line) for line in lines]
        return [record for record in records if record.get("JobId") == str(job_id)]

    def job_state(self, job_id: int) -> str:
        """The job's state (RUNNING, PENDING, COMPLETED, ...; a requeued job is PENDING until it runs again).

        Read from ``scontrol show job``; once the controller has purged the finished job (MinJobAge), from its
        last jobcomp record. 'UNKNOWN' when neither knows the job.
        """
        info = self.job_info(job_id)
        if info is not None:
            return info.get("JobState", "UNKNOWN")
        history = self.job_history(job_id)
        return history[-1].get("JobState", "UNKNOWN") if history else "UNKNOWN"

    def wait_job(self, job_id: int, states: Iterable[str] = FINISHED_STATES, timeout: float = 120.0) -> str:
        """Waits until the job is in one of STATES (default: any finished state) and returns that state.

        Raises TimeoutError naming the job, its last state and reason, and the controller's log. A query that the
        controller does not answer in time (a loaded machine starves it: "build_job_queue has run for 2000000
        usec" in its log) is asked again until TIMEOUT.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        state = "(no answer from slurmctld)"
        while True:
            try:
                state = self.job_state(job_id)
            except ClusterError:
                if time.monotonic() > deadline:
                    raise
            if state in wanted:
                return state
            if time.monotonic() > deadline:
                info = self.job_info(job_id) or {}
                raise TimeoutError(
                    f"job {job_id} not in {sorted(wanted)} after {timeout:.0f} s: state {state}, "
                    f"reason {info.get('Reason', '?')}; log: {self.log_dir / 'slurmctld.log'}"
                )
            time.sleep(0.5)

    @contextlib.contextmanager
    def slurmd_timeout(self, seconds: int):
        """Within the block, slurmctld marks a silent node DOWN only after SECONDS (``SlurmdTimeout``; Slurm's
        default is 300, the cluster's own 20 keeps the other tests quick): slurm.conf rewritten and ``scontrol
        reconfigure``d, and put back after the block."""
        self.slurm_conf.write_text(self._slurm_conf(slurmd_timeout=seconds))
        self.scontrol("reconfigure")
        try:
            yield
        finally:
            self.slurm_conf.write_text(self._slurm_conf())
            self.scontrol("reconfigure", check=False)

    def kill_node(self, node: str) -> None:
        """Kills every process of NODE at once (slurmd, sshd, job steps and their ranks): SIGKILL to its PID 1.

        The node's network stays (its address answers with refusals, as a host whose daemons died); slurmctld
        marks it DOWN after SlurmdTimeout (20 s) without an answer.
        """
        self._kill_recorded(f"node-{node}")

    def disconnect_node(self, node: str) -> None:
        """Takes NODE's link to the bridge down (a dead NIC or cable): its processes run on, nothing reaches it."""
        _run(["ip", "link", "set", host_veth(node), "down"])

    def reconnect_node(self, node: str) -> None:
        """Brings NODE's link to the bridge up again (after ``disconnect_node``)."""
        _run(["ip", "link", "set", host_veth(node), "up"])

    def restart_node(self, node: str, timeout: float = START_TIMEOUT_S) -> None:
        """Starts a killed (or running: it is killed first) NODE again and waits until its new slurmd registered.

        With ReturnToService=2 a node that was DOWN for not responding becomes usable again by itself.
        """
        self._kill_recorded(f"node-{node}")
        since = time.time()
        self._start_node(node)
        self._wait_node_up(node, since=since, timeout=timeout)

    def resume_node(self, node: str, timeout: float = 30.0) -> None:
        """``scontrol update nodename=NODE state=resume`` and waits until the node is usable again.

        Usable: not DOWN, DRAIN(ED) or FAIL, and responding (slurmctld marks a resumed node NOT_RESPONDING until
        its slurmd answers the ping that follows).
        """
        self.scontrol("update", f"nodename={node}", "state=resume", check=False)
        self._wait(
            f"resume of {node}",
            lambda: not self._unusable(self.node_info(node).get("State", "*")),
            self.log_dir / "slurmctld.log",
            timeout,
        )

    @staticmethod
    def _unusable(state: str) -> bool:
        """Whether a node state (``scontrol show node``'s State=) keeps jobs off the node."""
        return bool(re.search(r"DOWN|DRAIN|FAIL|NOT_RESPONDING|UNKNOWN|FUTURE|\*", state))

    def node_pids(self, node: str) -> list[int]:
        """Root-namespace pids of every process in NODE's PID namespace (PID 1 included)."""
        target = os.readlink(f"/proc/{self._init_pid(node)}/ns/pid")
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "pid") == target:
                        pids.append(int(entry.name))
                except OSError:
                    continue
        return sorted(pids)

    def job_pids(self, job_id: int, node: str) -> list[int]:
        """Root-namespace pids of every process of JOB_ID on NODE (its slurmstepds, the batch script, the tasks).

        Read from the job's cgroups of the freezer hierarchy, where proctrack/cgroup keeps them; an empty list
        when the job has no process there (not started, ended, or not on NODE).
        """
        cgroups = json.loads((self.state_dir / "cgroups.json").read_text())
        relative = cgroups.get("/sys/fs/cgroup/freezer", "/")
        base = Path("/sys/fs/cgroup/freezer" + (relative if relative != "/" else "")) / f"slurm_{node}"
        pids = set()
        for procs in base.glob(f"uid_*/job_{job_id}/**/cgroup.procs"):
            try:
                pids.update(int(pid) for pid in procs.read_text().split())
            except OSError:  # the step ended while we read
                continue
        return sorted(pids)

    def rank_pid(self, job_id: int, node: str, timeout: float = 30.0) -> int:
        """The root-namespace pid of JOB_ID's training rank on NODE (its ``launchers/train.py`` process, not the
        srun or slurmstepd beside it); ClusterError when none appears within TIMEOUT."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid in self.job_pids(job_id, node):
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"launchers/train.py" in command and not command[0].endswith(b"srun"):
                    return pid
            time.sleep(0.2)
        raise ClusterError(f"no training rank of job {job_id} on {node} within {timeout:.0f} s")

    def logs(self) -> list[Path]:
        """The log files of the cluster: slurmctld, every slurmd, munged, sshd, node PID 1s."""
        return sorted(self.log_dir.glob("*.log")) + sorted(self.log_dir.glob("*.stdout"))

    def dump_logs(self, lines: int = 40) -> str:
        """The last LINES of each log of the cluster, each under a header with its path (for failing tests)."""
        parts = []
        for path in self.logs():
            if path.name == "jobcomp.txt":
                continue
            parts.append(f"==> {path} <==\n{_tail(path, lines)}")
        parts.append(f"==> {self.jobcomp_log} <==\n{_tail(self.jobcomp_log, lines)}")
        return "\n".join(parts)

    def status(self) -> str:
        """A short, human-readable state of the cluster: sinfo and squeue."""
        sinfo = _run(["sinfo", "-N", "-o", "%N %T %c %m %E"], check=False, env=self.env())
        squeue = _run(["squeue", "-o", "%i %j %T %R"], check=False, env=self.env())
        return f"{sinfo.stdout}{sinfo.stderr}{squeue.stdout}{squeue.stderr}"


def _parse_scontrol(line: str) -> dict[str, str]:
    """A one-line ``scontrol show -o`` (or jobcomp/filetxt) record as a dict; values may contain spaces."""
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    record = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        record[match.group(1)] = line[match.end() : end].strip()
    return record


def attach(state_dir: str | os.PathLike = DEFAULT_STATE_DIR) -> Cluster:
    """A Cluster object for a cluster brought up by another process (``up``) in STATE_DIR, to inspect or stop it."""
    cluster = Cluster(Path(state_dir))
    for pid_file in sorted(cluster.pid_dir.glob("*.pid")) if cluster.pid_dir.is_dir() else []:
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        cluster._daemons[pid_file.stem] = _Daemon(pid_file.stem, None, pid, cluster.log_dir / f"{pid_file.stem}.log")
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
