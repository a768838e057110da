"""What the test cluster needs of the machine that hosts it, and how the harness runs things there.

The Debian packages and commands it needs (``check_machine`` says in one line what is missing), the two errors every
part of the cluster raises, the harness's own commands (``run_command``: /usr/sbin on PATH, output captured, a
failure raised with its stderr), reading processes in /proc (a pid file is only trusted with its process's start
time), the cgroup v1 hierarchies the nodes are nested in, and the polling wait that every start uses.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
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
# Every wait in the harness ends after at most this long (seconds) unless the caller gives another.
START_TIMEOUT_S = 60.0


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the cluster (not root, no namespaces, a missing tool, the subnet in use)."""


class ClusterError(RuntimeError):
    """A part of the cluster did not come up or did not respond in time; the message names it and its log."""


def with_sbin(env: Mapping[str, str]) -> dict[str, str]:
    """ENV with /usr/sbin and /sbin on PATH (the daemons and `ip` live there; a CI shell may not have them)."""
    env = dict(env)
    parts = env.get("PATH", os.defpath).split(os.pathsep)
    env["PATH"] = os.pathsep.join(parts + [part for part in ("/usr/sbin", "/sbin") if part not in parts])
    return env


def run_command(
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
            env=with_sbin(os.environ if env is None else env),
            input=input,
        )
    except subprocess.TimeoutExpired as error:
        raise ClusterError(f"{shlex.join(argv)} did not finish within {timeout:.0f} s") from error
    if check and result.returncode != 0:
        last_line = ((result.stderr or result.stdout).strip().splitlines() or [""])[-1]
        raise ClusterError(f"{shlex.join(argv)} failed (exit {result.returncode}): {last_line}")
    return result


def process_start_time(pid: int) -> str | None:
    """The start time of a live process (field 22 of /proc/PID/stat); None when there is none, or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def command_line(pid: int) -> str:
    """The command line of a process, shortened, or '?'."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
        return " ".join(words)[:120]
    except OSError:
        return "?"


def tail(path: Path, lines: int) -> str:
    """The last lines of a text file, or a line saying it does not exist."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path} does not exist)\n"
    return "".join(text.splitlines(keepends=True)[-lines:])


def own_cgroups_v1() -> dict[str, str]:
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
    search_path = with_sbin(os.environ)["PATH"]
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


def wait_until(
    what: str, ready: Callable[[], bool], log: Path, timeout: float, process: subprocess.Popen | None = None
) -> None:
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
