"""Smoke tests of the two-node test cluster: Slurm, ssh/pdsh and the nodes' namespaces work as on a real cluster.

Also the memory behaviour of job steps under CR_Core_Memory that issue 23's item 1 hit: while one step holds all
of a job's memory, a second step (the time-limit helper of launchers/slurm.sbatch) is refused unless it asks for
no memory of its own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.cluster.host import ClusterError

pytestmark = pytest.mark.cluster


def slurm(cluster, argv: list[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
    """Runs a Slurm client command from the root namespace against CLUSTER."""
    return subprocess.run(argv, capture_output=True, text=True, env=cluster.env(), timeout=timeout, **kwargs)


@pytest.fixture
def job_dir(tmp_path):
    """A fresh directory for a job's script and outputs (the filesystem is shared by the nodes and the tests)."""
    return tmp_path


def test_srun_runs_one_task_on_each_node(slurm_cluster):
    result = slurm(slurm_cluster, ["srun", "-N2", "--ntasks-per-node=1", "hostname"])
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == sorted(slurm_cluster.nodes)


def test_sbatch_two_node_job_sees_each_node_name_and_address(slurm_cluster, job_dir):
    script = job_dir / "job.sh"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        srun bash -c 'echo "$(hostname) $(hostname -I) $SLURMD_NODENAME" > {job_dir}/task-$SLURM_PROCID'
        """)
    )
    job_id = slurm_cluster.sbatch(["-N2", "--ntasks-per-node=1", f"--output={job_dir}/out.txt", str(script)])
    assert slurm_cluster.wait_job(job_id, timeout=60) == "COMPLETED", (job_dir / "out.txt").read_text()
    seen = {}
    for task in (0, 1):
        name, address, slurmd_name = (job_dir / f"task-{task}").read_text().split()
        assert name == slurmd_name
        seen[name] = address
    assert seen == {node: slurm_cluster.address(node) for node in slurm_cluster.nodes}
    deadline = time.monotonic() + 10.0
    while not slurm_cluster.job_history(job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [record["JobState"] for record in slurm_cluster.job_history(job_id)] == ["COMPLETED"]


def test_pdsh_over_ssh_reaches_both_nodes(slurm_cluster):
    nodes = ",".join(slurm_cluster.nodes)
    result = subprocess.run(
        ["pdsh", "-w", nodes, "hostname"], capture_output=True, text=True, env=slurm_cluster.ssh_env(), timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"{node}: {node}" for node in sorted(slurm_cluster.nodes)]
    # Inside a node the harness's ssh client config is the system one: plain ssh and pdsh need nothing more.
    first, second = slurm_cluster.nodes
    inside = slurm_cluster.run_on(
        first, ["pdsh", "-R", "ssh", "-w", nodes, "hostname -I"], timeout=30, env={"PDSH_SSH_ARGS_APPEND": ""}
    )
    assert inside.returncode == 0, inside.stderr
    assert sorted(inside.stdout.split()) == sorted(
        [f"{node}:" for node in slurm_cluster.nodes] + [slurm_cluster.address(node) for node in slurm_cluster.nodes]
    )
    hop = slurm_cluster.run_on(first, ["ssh", second, "hostname"], timeout=30)
    assert (hop.returncode, hop.stdout.strip()) == (0, second), hop.stderr
    # Plain `ssh NODE` from the root namespace (what deepspeed's runner runs before pdsh) with ssh_env().
    probe = subprocess.run(
        ["ssh", "-o", "PasswordAuthentication=no", first, "hostname -I"],
        capture_output=True,
        text=True,
        env=slurm_cluster.ssh_env(),
        timeout=30,
    )
    assert (probe.returncode, probe.stdout.split()) == (0, [slurm_cluster.address(first)]), probe.stderr


def test_run_on_sees_the_node_as_a_job_step_does(slurm_cluster):
    first, second = slurm_cluster.nodes
    result = slurm_cluster.run_on(
        first,
        ["bash", "-c", "hostname; hostname -I; getent hosts " + second + "; cat /proc/1/cmdline | tr '\\0' ' '"],
        timeout=10,
        check=True,
    )
    name, addresses, peer, init = result.stdout.splitlines()
    assert (name, addresses.split()) == (first, [slurm_cluster.address(first)])
    assert peer.split() == [slurm_cluster.address(second), second]
    assert "node_init.py" in init  # PID 1 of the node's own PID namespace
    # Slurm's client commands find the cluster's slurm.conf as /etc/slurm/slurm.conf on a node, as on a cluster.
    sinfo = slurm_cluster.run_on(first, ["env", "-u", "SLURM_CONF", "sinfo", "-h", "-N", "-o", "%N"], timeout=30)
    # -N lists a node once per partition: the two training nodes are in both, the spare in its own only.
    assert (sinfo.returncode, sorted(set(sinfo.stdout.split()))) == (0, sorted(slurm_cluster.all_nodes)), sinfo.stderr


@pytest.mark.parametrize(
    ("job_memory", "memory_env", "plain_overlap_refused"),
    [
        ([], "SLURM_MEM_PER_CPU=2000", True),  # the cluster's DefMemPerCPU, as most clusters set one
        (["--mem-per-cpu=2000"], "SLURM_MEM_PER_CPU=2000", True),
        (["--mem=4000"], "SLURM_MEM_PER_NODE=4000", False),
    ],
    ids=["DefMemPerCPU", "mem-per-cpu", "mem-per-node"],
)
def test_step_memory_under_cr_core_memory(slurm_cluster, job_dir, job_memory, memory_env, plain_overlap_refused):
    """What a second step needs while the first holds all the job's memory (Slurm 22.05, CR_Core_Memory).

    With memory per CPU (DefMemPerCPU or --mem-per-cpu; SLURM_MEM_PER_CPU is exported into the batch script and
    read by every srun in it) the helper step as launchers/slurm.sbatch starts it (``--overlap --cpus-per-task=1``)
    asks for its CPU's share, which the first step holds, and is refused with "Memory required by task is not
    available". With ``--mem=0`` or ``--mem-per-cpu=0`` it reserves no memory (its cgroup limit is the job's) and
    runs, whatever the job's memory request. A step with ``--mem`` inside the allocation runs while no other step
    holds the memory.
    """
    script = job_dir / "job.sh"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        out={job_dir}
        env | grep '^SLURM_MEM' > $out/env.txt
        srun --ntasks-per-node=1 --mem=1000 hostname > $out/mem-within.txt 2>&1; echo $? >> $out/mem-within.txt
        srun --ntasks-per-node=1 --cpus-per-task=2 bash -c "touch $out/holder-\\$SLURM_PROCID; exec sleep 120" &
        for _ in $(seq 300); do [ -e $out/holder-0 ] && [ -e $out/holder-1 ] && break; sleep 0.1; done
        try() {{
            name=$1; shift
            timeout 20 srun "$@" --ntasks-per-node=1 --cpus-per-task=1 hostname > $out/$name.txt 2>&1
            echo $? >> $out/$name.txt
        }}
        try overlap --overlap
        try overlap-mem0 --overlap --mem=0
        try overlap-mem-per-cpu0 --overlap --mem-per-cpu=0
        kill %1
        wait
        """)
    )
    job_id = slurm_cluster.sbatch(
        ["-N2", "--ntasks-per-node=1", "--cpus-per-task=2", *job_memory, f"--output={job_dir}/out.txt", str(script)]
    )
    assert slurm_cluster.wait_job(job_id, timeout=90) == "COMPLETED", (job_dir / "out.txt").read_text()
    assert (job_dir / "env.txt").read_text().strip() == memory_env

    def step(name: str) -> tuple[str, list[str]]:
        lines = (job_dir / name).read_text().splitlines()
        return lines[-1], lines[:-1]

    status, output = step("mem-within.txt")
    assert status == "0" and sorted(output) == sorted(slurm_cluster.nodes), output
    status, output = step("overlap.txt")
    if plain_overlap_refused:
        assert status == "1" and any("Memory required by task is not available" in line for line in output), output
    else:
        assert status == "0" and sorted(output) == sorted(slurm_cluster.nodes), output
    for name in ("overlap-mem0.txt", "overlap-mem-per-cpu0.txt"):
        status, output = step(name)
        assert status == "0" and sorted(output) == sorted(slurm_cluster.nodes), (name, output)


def test_kill_node_kills_every_process_and_restart_brings_it_back(slurm_cluster):
    first, second = slurm_cluster.nodes
    sleeper = slurm_cluster.popen_on(
        second, ["bash", "-c", "echo started; exec sleep 300"], stdout=subprocess.PIPE, text=True
    )
    assert sleeper.stdout.readline() == "started\n"
    pids = slurm_cluster.node_pids(second)
    assert len(pids) >= 4  # PID 1, sshd, slurmd, sleep
    slurm_cluster.kill_node(second)
    sleeper.wait(timeout=10)
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(ClusterError, match=f"node {second} is not running"):
        slurm_cluster.run_on(second, ["true"])
    slurm_cluster.restart_node(second)
    assert slurm_cluster.node_info(second)["State"] == "IDLE"
    slurm_cluster.scontrol("update", f"nodename={second}", "state=drain", "reason=smoke test")
    assert slurm_cluster.node_info(second)["State"] == "IDLE+DRAIN"
    slurm_cluster.resume_node(second)
    assert slurm_cluster.node_info(second)["State"] == "IDLE"
    result = slurm(slurm_cluster, ["srun", "-N2", "--ntasks-per-node=1", "hostname"])
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == sorted(slurm_cluster.nodes)


def _alive(pid: int) -> bool:
    """Whether a process PID exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_disconnect_node_cuts_its_network_until_reconnected(slurm_cluster):
    second = slurm_cluster.nodes[1]
    slurm_cluster.disconnect_node(second)
    try:
        with pytest.raises(OSError):
            socket.create_connection((slurm_cluster.address(second), 22), timeout=1.0).close()
    finally:
        slurm_cluster.reconnect_node(second)
    deadline = time.monotonic() + 10.0
    while True:
        try:
            socket.create_connection((slurm_cluster.address(second), 22), timeout=1.0).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"{second} not reachable 10 s after reconnect_node"
            time.sleep(0.2)


def test_job_pids_are_the_job_processes_on_each_node(slurm_cluster, job_dir):
    job_id = slurm_cluster.sbatch(
        ["-N2", "--ntasks-per-node=1", f"--output={job_dir}/out.txt", "--wrap", "srun sleep 300"]
    )
    try:
        slurm_cluster.wait_job(job_id, "RUNNING", timeout=30)
        for node in slurm_cluster.nodes:
            deadline = time.monotonic() + 20.0
            while "sleep" not in (commands := _commands(slurm_cluster.job_pids(job_id, node))):
                assert time.monotonic() < deadline, f"no sleep task of job {job_id} on {node}: {commands}"
                time.sleep(0.2)
            assert "slurmstepd" in commands
            assert set(slurm_cluster.job_pids(job_id, node)) <= set(slurm_cluster.node_pids(node))
    finally:
        subprocess.run(["scancel", str(job_id)], env=slurm_cluster.env(), timeout=30)
    slurm_cluster.wait_job(job_id, timeout=60)
    deadline = time.monotonic() + 20.0  # a cancelled job's processes may take KillWait to go
    while any(slurm_cluster.job_pids(job_id, node) for node in slurm_cluster.nodes):
        assert time.monotonic() < deadline, f"processes of job {job_id} left 20 s after it ended"
        time.sleep(0.2)


def _commands(pids: list[int]) -> list[str]:
    """The command names of PIDS (those still alive)."""
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue
    return names


def test_slurm_nodes_reads_a_drained_node_of_a_running_job_as_lost(slurm_cluster, job_dir):
    """txl_dist.supervision.slurm_nodes (the relaunch decision of launchers/slurm.sbatch) against the real controller: a
    node of a running job that an administrator drains is one the next step must avoid; the other is kept."""
    job_id = slurm_cluster.sbatch(["-N2", "--ntasks-per-node=1", f"--output={job_dir}/out.txt", "--wrap=sleep 120"])
    try:
        assert slurm_cluster.wait_job(job_id, "RUNNING", timeout=60) == "RUNNING"
        slurm_cluster.scontrol("update", f"nodename={slurm_cluster.nodes[1]}", "state=drain", "reason=txl-test")
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "txl_dist.supervision.slurm_nodes",
                "relaunch",
                "--job",
                str(job_id),
                "--step-nodes",
                ",".join(slurm_cluster.nodes),
                "--ranks-per-node",
                "1",
                "--relaunches",
                "0",
                "--",
                f"train.output_dir={job_dir}/run",
            ],
            capture_output=True,
            text=True,
            env=slurm_cluster.env({"TXL_MIN_NODES": "1"}),
            timeout=60,
        )
    finally:
        slurm_cluster.resume_node(slurm_cluster.nodes[1])
        slurm(slurm_cluster, ["scancel", str(job_id)])
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"relaunch 1 {slurm_cluster.nodes[0]} -\n", result.stderr
    assert f"lost {slurm_cluster.nodes[1]} (State=" in result.stderr and "DRAIN" in result.stderr, result.stderr
    assert "before its first logged step; newest checkpoint: the start (no checkpoint yet)" in result.stderr
