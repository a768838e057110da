"""The test cluster's state directory and the files written into it before anything starts.

``ClusterFiles`` (the lowest layer of ``Cluster``, tests/cluster/harness.py) knows where everything lies: configs
under etc/, logs under log/ (the previous start's in log.previous/), pid files under pids/, ssh keys and configs under
ssh/, munge's key and socket under munge/, per node its host key and sshd_config under nodes/NODE/, and shared/ (the
cluster's shared filesystem). It writes slurm.conf (partitions ``PARTITION`` of the training nodes and
``SPARE_PARTITION`` of all three; cons_tres with CR_Core_Memory, DefMemPerCPU, requeue, short timeouts), cgroup.conf,
an empty plugstack.conf, the hosts file the nodes mount as /etc/hosts, and an ssh client config (node names ->
addresses, the harness's key and known_hosts) with an ``ssh`` wrapper that reads it; and gives the environment in
which Slurm commands, ssh and pdsh reach this cluster (``env``, ``ssh_env``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from tests.cluster.host import own_cgroups_v1, run_command, with_sbin
from tests.cluster.network import CONTROLLER_ADDRESS, NODE_NAMES, node_address

TRAINING_NODES = 2
"""The nodes of the default partition (`Cluster.nodes`): where every job goes unless it names another partition.
The third node is only in `SPARE_PARTITION`, for the jobs that keep a spare node (TXL_SPARE_NODES)."""
NODE_CPUS = 2
NODE_MEMORY_MB = 4000
PARTITION = "txl"
SPARE_PARTITION = "txlspare"
"""A partition of all three nodes (`Cluster.all_nodes`): two that train and one kept as a spare."""
SLURMCTLD_PORT = 16817
SLURMD_PORT = 16818
SLURMD_TIMEOUT_S = 20
# The file that marks a directory as a test cluster's state directory (a start refuses any other non-empty one).
STATE_MARKER = ".txl_cluster_state"


class ClusterFiles:
    """The paths of a cluster's state directory and its nodes, and the files written there (module docstring)."""

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

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm commands in the root namespace: os.environ + SLURM_CONF (+ EXTRA)."""
        env = with_sbin(os.environ)
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
        (self.state_dir / "cgroups.json").write_text(json.dumps(own_cgroups_v1()))
        self._write_slurm_files()
        self._write_ssh_files()

    def _write_slurm_files(self) -> None:
        """The munge key, the hosts file, slurm.conf, cgroup.conf and plugstack.conf."""
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

    def _write_ssh_files(self) -> None:
        """The harness's client key, each node's host key and sshd_config, known_hosts, ssh_config and the wrapper."""
        client_key = self.ssh_dir / "id_ed25519"
        if not client_key.exists():
            run_command(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "txl-cluster", "-f", str(client_key)])
        (self.ssh_dir / "authorized_keys").write_text(Path(f"{client_key}.pub").read_text())
        known_hosts = []
        for node in self.all_nodes:
            node_dir = self.state_dir / "nodes" / node
            host_key = node_dir / "ssh_host_ed25519_key"
            if not host_key.exists():
                run_command(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", node, "-f", str(host_key)])
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
            "# Written by tests/cluster/cluster_files.py: a two-node test cluster on one machine.\n"
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
