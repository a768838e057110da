"""The test cluster's processes: its daemons, its nodes' first processes, and commands run inside a node.

``ClusterProcesses`` (a layer of ``Cluster``, tests/cluster/harness.py, above ``SlurmClient``) starts ``munged``
(own key and socket under the state directory) and ``slurmctld`` in the root namespace, and each node: a PID 1
(node_init.py) in the node's network namespace and new UTS, mount and PID namespaces, which mounts the node's
/etc/hosts, /etc/slurm, ssh client config, /run and /dev/shm and starts the node's ``sshd`` and ``slurmd -N NODE``.
Every process it starts has a pid file (pid and start time, so that a reused pid is never killed) by which a later
harness finds and kills it. It runs commands inside a node as a job step sees the node, and finds the processes of
a node or of a job (in the job's freezer cgroups, where proctrack/cgroup keeps them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.host import ClusterError, own_cgroups_v1, process_start_time, wait_until
from tests.cluster.network import namespace_name, node_address
from tests.cluster.slurm_client import SlurmClient

NODE_INIT = Path(__file__).with_name("node_init.py")


@dataclass
class _Daemon:
    """A process the harness started (root side), with its pid file and log."""

    name: str
    process: subprocess.Popen | None
    pid: int
    log: Path


class ClusterProcesses(SlurmClient):
    """The processes the harness starts and the commands it runs in the nodes (module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)
        self._daemons: dict[str, _Daemon] = {}

    # ------------------------------------------------------------------ pid files

    def _record(self, name: str, process: subprocess.Popen, pid: int, log: Path) -> None:
        """Writes the pid file of a started process (pid and start time, so a reused pid is never killed)."""
        start_time = process_start_time(pid)
        (self.pid_dir / f"{name}.pid").write_text(f"{pid} {start_time}\n")
        self._daemons[name] = _Daemon(name, process, pid, log)

    def _adopt_recorded(self) -> None:
        """Takes the processes of the pid files as this object's own (a cluster another process brought up)."""
        for pid_file in sorted(self.pid_dir.glob("*.pid")) if self.pid_dir.is_dir() else []:
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            self._daemons[pid_file.stem] = _Daemon(pid_file.stem, None, pid, self.log_dir / f"{pid_file.stem}.log")

    def _live_pids(self) -> list[int]:
        """The pids of this state directory's pid files whose processes are still the ones recorded."""
        live = []
        for pid_file in sorted(self.pid_dir.glob("*.pid")) if self.pid_dir.is_dir() else []:
            try:
                pid_text, start_time = pid_file.read_text().split()
                pid = int(pid_text)
            except (OSError, ValueError):
                continue
            if process_start_time(pid) == start_time:
                live.append(pid)
        return live

    def _kill_recorded(self, name: str) -> None:
        """SIGKILLs the process of pid file NAME if it is still the one recorded, waits for it, removes the file."""
        pid_file = self.pid_dir / f"{name}.pid"
        daemon = self._daemons.pop(name, None)
        try:
            pid_text, start_time = pid_file.read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            pid, start_time = None, None
        if pid is not None and process_start_time(pid) == start_time:
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
        while pid is not None and process_start_time(pid) == start_time and time.monotonic() < deadline:
            time.sleep(0.05)
        # A node's PID 1 is the child of `unshare`; the kernel has killed the rest of its namespace with it.
        pid_file.unlink(missing_ok=True)

    def _remove_cgroups(self) -> None:
        """Removes the (empty) cgroup directories slurmd made for the nodes, deepest first."""
        try:  # the cgroups the nodes were nested in when they started (a later `down` may run elsewhere)
            cgroups = json.loads((self.state_dir / "cgroups.json").read_text())
        except (OSError, ValueError):
            cgroups = own_cgroups_v1()
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

    # ------------------------------------------------------------------ starting

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

        wait_until("munged", works, log, timeout, process)

    def _start_slurmctld(self, timeout: float) -> None:
        """slurmctld in the root namespace, in the foreground, with a clean state."""
        log = self.log_dir / "slurmctld.log"
        process = self._spawn(
            "slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.slurm_conf)], self.log_dir / "slurmctld.stdout"
        )

        def answers() -> bool:
            result = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, env=self.env(), timeout=15)
            return "is UP" in result.stdout

        wait_until("slurmctld", answers, log, timeout, process)

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
        wait_until(f"node {node} (node_init.py)", ready_file.exists, log, 20.0, process)

    def _wait_node_up(self, node: str, since: float, timeout: float) -> None:
        """Waits until NODE's sshd accepts connections and its slurmd (started after SINCE, epoch s) has registered."""
        log = self.log_dir / f"slurmd-{node}.log"

        def sshd_up() -> bool:
            try:
                with socket.create_connection((node_address(node), 22), timeout=1.0):
                    return True
            except OSError:
                return False

        wait_until(f"sshd of {node} ({node_address(node)}:22)", sshd_up, self.log_dir / f"sshd-{node}.log", timeout)

        def registered() -> bool:
            info = self.node_info(node)
            if self._unusable(info.get("State", "*")):
                return False
            started = info.get("SlurmdStartTime", "None")
            if since and started not in ("None", ""):
                if time.mktime(time.strptime(started, "%Y-%m-%dT%H:%M:%S")) < since - 1:
                    return False
            return True

        wait_until(f"slurmd of {node}", registered, log, timeout)

    # ------------------------------------------------------------------ inside the nodes

    def _init_pid(self, node: str) -> int:
        """The root-namespace pid of the node's PID 1; ClusterError when the node is not running."""
        daemon = self._daemons.get(f"node-{node}")
        if daemon is None or process_start_time(daemon.pid) is None:
            raise ClusterError(f"node {node} is not running (killed, or not started)")
        return daemon.pid

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
