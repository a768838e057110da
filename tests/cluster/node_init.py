"""The first process (PID 1) of one test-cluster node: gives the node its view of the machine, then runs its daemons.

Started by ``harness.Cluster`` as ``nsenter --net=<netns> unshare --uts --mount --pid --fork --mount-proc python
node_init.py NODE_JSON``, so it runs in the node's network namespace and in a UTS, mount and PID namespace of its own.
It sets the hostname, bind-mounts the node's /etc/hosts, /etc/slurm and /etc/ssh/ssh_config, gives the node its own
/run and /dev/shm (as separate machines have), nests the cgroup hierarchies under the harness's own cgroups (so that
job cgroups stay inside whatever limits the harness runs under), then starts sshd and ``slurmd -N NODE``. It reaps
every orphan of the namespace (slurmstepd, job processes) and, on SIGTERM, ends the node: when PID 1 of a PID namespace
exits the kernel kills every other process in it, which is also how ``Cluster.kill_node`` kills a node at once.

Standard library only: it runs before anything of the project is importable in the node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def mount(*args: str) -> None:
    """Runs ``mount ARGS``; a failure ends the node with the command in the message."""
    subprocess.run(["mount", *args], check=True)


def nest_cgroups(own_cgroups: dict[str, str]) -> None:
    """Bind-mounts each cgroup v1 hierarchy's subtree of the harness over the hierarchy's mount point.

    Slurm's cgroup/v1 plugin builds its tree from the hierarchy root; seen from this mount namespace the root is
    the harness's cgroup, so job cgroups are created below it and its limits apply to them.
    """
    for mount_point, relative in own_cgroups.items():
        if relative not in ("", "/"):
            mount("--bind", mount_point + relative, mount_point)


def main() -> int:
    node = json.loads(sys.argv[1])
    socket.sethostname(node["name"])
    mount("--make-rprivate", "/")
    mount("--bind", node["hosts_file"], "/etc/hosts")
    mount("--bind", node["slurm_etc"], "/etc/slurm")
    mount("--bind", node["ssh_config"], "/etc/ssh/ssh_config")
    mount("-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    os.makedirs("/run/lock", mode=0o1777, exist_ok=True)
    mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm")
    nest_cgroups(node["cgroups"])

    children = []
    for argv, log in ((node["sshd_argv"], node["sshd_log"]), (node["slurmd_argv"], node["slurmd_stdout"])):
        with open(log, "ab") as out:
            children.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
    with open(node["ready_file"], "w", encoding="utf-8") as ready:
        ready.write(" ".join(str(child.pid) for child in children) + "\n")

    stopping = False

    def stop(signum, frame):  # noqa: ARG001 - signal handler signature
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        try:
            os.waitpid(-1, 0)  # reaps every orphan of the namespace, not only our children
        except ChildProcessError:
            time.sleep(1.0)
        except InterruptedError:
            pass
    # Let slurmd and sshd end cleanly for a moment; whatever is left dies with PID 1.
    for child in children:
        if child.poll() is None:
            child.terminate()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(child.poll() is None for child in children):
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
