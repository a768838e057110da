"""Every way users start a job, run for real on the two-node test cluster (tests/cluster/harness.py): each trains
with the per-step losses of a 2-rank torchrun reference of the same run, and Slurm's time limit, scancel,
preemption and a lost node below TXL_MIN_NODES end as docs/clusters.md says (the run: tests/cluster/runs.py; elastic
runs: tests/cluster/test_elastic.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.runs import (
    CPU,
    DEEPSPEED,
    PYTHON,
    REFERENCE_STEPS,
    assert_same_losses,
    fresh,
    job_output,
    losses,
    newest_checkpoint,
    running_at_step,
    sbatch_job,
    train_args,
)
from tests.launcher import REPO, environment, free_port

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("slurm_cluster")]


def deepspeed_on_first_node(
    cluster, directory: Path, flags: list[str], steps: int, env: dict[str, str], output: Path | None = None
) -> str:
    """`deepspeed --hostfile H FLAGS launchers/train.py ...` typed on the first node, as a user does; its output,
    after it has exited 0."""
    hostfile = directory / "hostfile"
    hostfile.write_text("".join(f"{node} slots=1\n" for node in cluster.nodes))
    result = cluster.run_on(
        cluster.nodes[0],
        [
            DEEPSPEED,
            "--hostfile",
            str(hostfile),
            *flags,
            "launchers/train.py",
            *train_args(directory.parent / "shards", output or directory / "run", steps),
        ],
        env=env,
        cwd=REPO,
        timeout=240,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    return out


def two_hosts(text: str) -> bool:
    """The ranks' start-up line names both nodes."""
    return bool(re.search(r"ranks' environment: .* on txlnode1, txlnode2", text))


# ---- the launch paths ------------------------------------------------------------------------------------------


def test_sbatch_trains_one_rank_per_node_with_the_reference_losses(slurm_cluster, shared, reference):
    """`sbatch launchers/slurm.sbatch` on CPU nodes without any GPU resource: ranks from the allocation (one task
    per node), started by `srun python launchers/train.py` inside the script."""
    directory = fresh(shared, "sbatch")
    job = sbatch_job(slurm_cluster, directory, 30, "--time=5", "--signal=B:USR1@10")
    assert slurm_cluster.wait_job(job, timeout=180) == "COMPLETED", job_output(directory)
    out = job_output(directory)
    assert "1 rank(s) per node" in out and two_hosts(out), out[-3000:]
    assert_same_losses(directory / "run", reference, 30)


def test_srun_of_train_py_forms_one_world(slurm_cluster, shared, reference):
    """`srun -N2 python launchers/train.py`: each task is a rank (SLURM_PROCID of SLURM_NTASKS), not a world of
    its own."""
    directory = fresh(shared, "srun")
    result = subprocess.run(
        [
            "srun",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--mem=1500",
            "--kill-on-bad-exit=1",
            PYTHON,
            "-u",
            "launchers/train.py",
            *train_args(shared / "shards", directory / "run", 20),
        ],
        cwd=REPO,
        env=slurm_cluster.env(CPU),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert two_hosts(result.stderr), result.stderr[-3000:]
    assert_same_losses(directory / "run", reference, 20)


def test_deepspeed_launcher_slurm_forms_one_world(slurm_cluster, shared, reference):
    """`deepspeed --launcher slurm`: srun starts `python train.py` once per slot; before, every task ran a
    one-rank world of its own ("is in use by another run")."""
    directory = fresh(shared, "ds-slurm")
    out = deepspeed_on_first_node(
        slurm_cluster,
        directory,
        ["--launcher", "slurm", "--launcher_args=--ntasks-per-node=1 --cpus-per-task=1 --mem=1500"],
        20,
        CPU,
    )
    assert two_hosts(out) and "on 2 rank(s)" in out, out[-3000:]
    assert_same_losses(directory / "run", reference, 20)


def _deepspeed_env(directory: Path) -> Path:
    """.deepspeed_env written as docs/clusters.md says, from the variables set where deepspeed is typed."""
    path = directory / ".deepspeed_env"
    result = subprocess.run(
        [PYTHON, "-m", "txl_dist.rendezvous.launch_env", "--write-deepspeed-env", "--path", str(path)],
        cwd=REPO,
        env={**environment(), **CPU},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return path


def test_deepspeed_hostfile_over_pdsh_brings_the_users_environment_to_every_rank(slurm_cluster, shared, reference):
    """`deepspeed --hostfile` typed on the first node: pdsh starts DeepSpeed's launcher on each node over ssh,
    with only the variables of .deepspeed_env (and a few families) exported: the ranks report the user's
    accelerator and threads, and the same values on both hosts."""
    directory = fresh(shared, "pdsh")

    def launch(output: Path, steps: int, env_file: Path) -> str:
        flags = ["--master_addr", slurm_cluster.nodes[0], "--master_port", str(free_port())]
        return deepspeed_on_first_node(
            slurm_cluster, directory, flags, steps, slurm_cluster.ssh_env({**CPU, "DS_ENV_FILE": str(env_file)}), output
        )

    # Without .deepspeed_env the user's variables reach no rank, and the run says so.
    bare = launch(directory / "bare", 1, directory / "none")
    assert "started over ssh (deepspeed --hostfile) without a .deepspeed_env" in bare, bare[-3000:]
    assert re.search(r"ranks' environment: accelerator cpu, [^\n]*deepspeed [0-9.]+, TORCH_EXTENSIONS_DIR=", bare)
    out = launch(directory / "run", 20, _deepspeed_env(directory))
    started = re.search(r"ranks' environment: (.*) on txlnode1, txlnode2", out)
    assert started, out[-3000:]
    assert "DS_ACCELERATOR=cpu" in started.group(1) and "OMP_NUM_THREADS=1" in started.group(1), started.group(0)
    assert "without a .deepspeed_env" not in out
    assert_same_losses(directory / "run", reference, 20)


def test_deepspeed_launcher_openmpi_forms_one_world(slurm_cluster, shared, reference):
    """`deepspeed --launcher openmpi` typed on the first node: mpirun starts the ranks over ssh; they read
    OMPI_COMM_WORLD_* and meet at mpirun's host. Before, this exited 0 after two single-rank runs."""
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is not installed (Debian's openmpi-bin: make cluster-packages)")
    directory = fresh(shared, "openmpi")
    env = slurm_cluster.ssh_env(
        {
            **CPU,
            "DS_ENV_FILE": str(_deepspeed_env(directory)),
            "OMPI_MCA_plm_rsh_args": f"-F {slurm_cluster.ssh_config}",
        }
    )
    out = deepspeed_on_first_node(
        slurm_cluster,
        directory,
        ["--launcher", "openmpi", "--launcher_args=--allow-run-as-root --map-by node"],
        20,
        env,
    )
    assert two_hosts(out) and "on 2 rank(s)" in out, out[-3000:]
    assert_same_losses(directory / "run", reference, 20)


# ---- Slurm's ways of ending a job --------------------------------------------------------------------------------

_DECOY = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], "w").write("terminated"), sys.exit(0)))
time.sleep(600)
"""


def _decoy_ranks(cluster, directory: Path) -> list[tuple[subprocess.Popen, Path]]:
    """Another user's training ranks on both nodes, outside any job: `python -u launchers/train.py` from their own
    checkout (what the old stop step's `pkill -f` pattern matched)."""
    checkout = directory / "other-user"
    (checkout / "launchers").mkdir(parents=True)
    (checkout / "launchers" / "train.py").write_text(_DECOY)
    decoys = []
    for node in cluster.nodes:
        marker = directory / f"decoy-{node}"
        process = cluster.popen_on(
            node,
            [PYTHON, "-u", "launchers/train.py", str(marker)],
            cwd=checkout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        decoys.append((process, marker))
    return decoys


def test_time_limit_checkpoints_requeues_and_the_run_completes_exactly(slurm_cluster, shared, reference):
    """--time=3 with the time-limit signal 170 s before it: the signal comes 10-40 s into the job (Slurm looks
    every 30 s; no job step can be added while training holds the job's memory). The job checkpoints, requeues
    itself and resumes exactly; the second run gets a longer limit from the test, and the run completes with every
    step's loss equal to the uninterrupted reference. Another user's `launchers/train.py` on the same nodes is
    left alone."""
    directory = fresh(shared, "timelimit")
    decoys = _decoy_ranks(slurm_cluster, directory)
    try:
        job = sbatch_job(slurm_cluster, directory, REFERENCE_STEPS, "--time=3", "--signal=B:USR1@170")
        deadline = time.monotonic() + 240
        while "requeueing job" not in job_output(directory):
            state = slurm_cluster.job_state(job)
            assert time.monotonic() < deadline and state in (
                "PENDING",
                "RUNNING",
                "CONFIGURING",
                "COMPLETING",
                "REQUEUED",
            ), (state, job_output(directory)[-3000:])
            time.sleep(0.5)
        slurm_cluster.scontrol("update", f"jobid={job}", "timelimit=10")
        assert slurm_cluster.wait_job(job, "COMPLETED", timeout=300) == "COMPLETED", job_output(directory)[-3000:]
        out = job_output(directory)
        assert "restart 0" in out and "restart 1" in out, out[-3000:]
        stopped = re.search(r"stopped by SIGTERM", out)
        resumed = re.search(r"resumed from \S+ at step (\d+) \(exact", out)
        assert stopped and resumed and 0 < int(resumed.group(1)) < REFERENCE_STEPS, out[-3000:]
        assert_same_losses(directory / "run", reference, REFERENCE_STEPS)
        for process, marker in decoys:
            assert process.poll() is None and not marker.exists(), "another user's train.py was signalled"
    finally:
        for process, _ in decoys:
            process.kill()
            process.wait()


def test_a_time_limit_signal_before_the_first_step_requeues_and_the_next_run_trains(slurm_cluster, shared, reference):
    """The time limit's USR1 while the script still checks the nodes (a --time shorter than the signal's lead sends
    it in the job's first seconds): the script neither dies of it (bash's default for USR1) nor starts training;
    it requeues the job, and the next run trains the whole run with the reference losses. Slurm delivers
    --signal=B:USR1 as a plain kill of the batch script; here the check (a TXL_PYTHON wrapper, on the first run
    only) sends that signal to its parent, the batch script, so that it lands while the check runs, every time."""
    directory = fresh(shared, "earlysignal")
    signalled = directory / "signalled"
    wrapper = directory / "python"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'if [ "$2" = txl_dist.supervision.slurm_nodes ] && [ "$3" = check ] && [ ! -e {signalled} ]; then\n'
        f'  touch {signalled} && kill -USR1 "$PPID" && sleep 1\n'
        "fi\n"
        f'exec {PYTHON} "$@"\n'
    )
    wrapper.chmod(0o755)
    job = sbatch_job(slurm_cluster, directory, 10, "--time=5", env={"TXL_PYTHON": str(wrapper)})
    assert slurm_cluster.wait_job(job, timeout=240) == "COMPLETED", job_output(directory)[-3000:]
    out = job_output(directory)
    first, _, second = out.partition("(restart 1)")
    assert signalled.exists() and second, out[-3000:]
    assert "time limit near" in first and "stop asked before the training step started" in first, first[-3000:]
    assert "no training step ran; requeueing job" in first and "ranks' environment" not in first, first[-3000:]
    assert "ranks' environment" in second and "resumed from" not in second, second[-3000:]
    assert_same_losses(directory / "run", reference, 10)


def test_scancel_checkpoints_and_does_not_requeue(slurm_cluster, shared, reference):
    directory = fresh(shared, "scancel")
    job = sbatch_job(slurm_cluster, directory, REFERENCE_STEPS, "--time=5", "--signal=B:USR1@10")
    running_at_step(slurm_cluster, job, directory, 5)
    subprocess.run(["scancel", str(job)], env=slurm_cluster.env(), check=True, timeout=30)
    assert slurm_cluster.wait_job(job, timeout=60) == "CANCELLED"
    time.sleep(6)  # longer than a requeued job would take to show up again as PENDING
    assert slurm_cluster.job_state(job) == "CANCELLED"
    out = job_output(directory)
    assert "SIGTERM: asking every rank to checkpoint" in out and "requeueing" not in out, out[-3000:]
    written = [int(step) for step in re.findall(r"checkpoint \S+/step(\d+) written", out)]
    assert written and max(written) > 5, out[-3000:]
    assert (directory / "run" / "checkpoints" / f"step{max(written):08d}" / "COMPLETE.json").is_file()


def test_preemption_checkpoints_and_slurm_requeues_the_job_which_resumes_exactly(slurm_cluster, shared, reference):
    """What PreemptMode=REQUEUE does to a running job (`scontrol requeue`): SIGTERM to every task of the job at
    once, SIGKILL KillWait later, and the job back in the queue. The ranks checkpoint within that time; Slurm's
    rerun resumes from that checkpoint and finishes with the reference losses."""
    directory = fresh(shared, "preempt")
    job = sbatch_job(slurm_cluster, directory, 60, "--time=5", "--signal=B:USR1@10")
    running_at_step(slurm_cluster, job, directory, 5)
    slurm_cluster.scontrol("requeue", str(job))
    assert slurm_cluster.wait_job(job, "COMPLETED", timeout=180) == "COMPLETED", job_output(directory)[-3000:]
    out = job_output(directory)
    stopped = re.findall(r"done: (\d+) steps \(\d+ this run\) in [0-9.]+ s, [0-9]+ tokens/s, stopped by SIGTERM", out)
    assert stopped and 5 <= int(stopped[0]) < 60, out[-3000:]
    assert re.search(rf"resumed from \S+ at step {stopped[0]} \(exact", out), out[-3000:]
    assert "restart 1" in out
    assert_same_losses(directory / "run", reference, 60)


def test_below_the_node_floor_a_lost_node_ends_the_job_naming_it_and_the_next_job_resumes(
    slurm_cluster, shared, reference
):
    """TXL_MIN_NODES=2 on two nodes: no world is small enough to go on with, so the job ends as it did before
    elastic runs (non-zero, --no-requeue here), naming the node, and the next job resumes."""
    directory = fresh(shared, "lostnode")
    job = sbatch_job(
        slurm_cluster,
        directory,
        REFERENCE_STEPS,
        "--time=5",
        "--signal=B:USR1@10",
        "--no-requeue",
        env={"TXL_MIN_NODES": "2"},
    )
    running_at_step(slurm_cluster, job, directory, 60)  # past the checkpoint of step 50
    lost = slurm_cluster.nodes[1]
    began = time.monotonic()
    slurm_cluster.kill_node(lost)
    try:
        state = slurm_cluster.wait_job(job, timeout=90)
        ended_in = time.monotonic() - began
        out = job_output(directory)
        assert state == "FAILED", (state, out[-3000:])
        assert ended_in < 60, f"the job took {ended_in:.0f} s to end"
        named = [line for line in out.splitlines() if line.startswith("train.py: error")]
        assert named and f"rank 1 ({lost}" in named[0] and "since its last checkpoint (step" in named[0], out[-3000:]
        assert "1 node(s) left, fewer than TXL_MIN_NODES=2: ending the job" in out, out[-3000:]
        assert "relaunching" not in out, out[-3000:]
    finally:
        slurm_cluster.restart_node(lost)
        slurm_cluster.resume_node(lost)
    newest = newest_checkpoint(directory / "run")
    again = sbatch_job(slurm_cluster, directory, newest + 10, "--time=5", "--signal=B:USR1@10")
    assert slurm_cluster.wait_job(again, timeout=180) == "COMPLETED", job_output(directory)[-3000:]
    assert re.search(rf"resumed from \S+ at step {newest} \(exact", job_output(directory)), job_output(directory)[
        -3000:
    ]
    got = losses(directory / "run")
    assert all(got[step] == reference[step] for step in range(newest + 1, newest + 11))


def test_a_time_limit_signal_while_the_relaunch_is_planned_still_requeues_the_job(slurm_cluster, shared, reference):
    """TXL_MAX_RELAUNCHES=0: a lost node sends the job back to the queue. The time limit's USR1 lands while the
    planner decides (a TXL_PYTHON wrapper sends it to the batch script, as Slurm's --signal=B: does, on the first
    run only): the job is requeued once, and its next run resumes from the checkpoint of step 50 with the
    reference's losses. Before, the log said "requeueing" twice, no requeue came and the job ended FAILED."""
    directory = fresh(shared, "signalplan")
    signalled = directory / "signalled"
    wrapper = directory / "python"
    # The batch script: the first ancestor whose parent runs another program (the planner runs in a command
    # substitution, a fork of the script with the script's command line).
    wrapper.write_text(
        "#!/bin/bash\n"
        f'if [ "$2" = txl_dist.supervision.slurm_nodes ] && [ "$3" = relaunch ] && [ ! -e {signalled} ]; then\n'
        "  script=$PPID\n"
        '  parent() { cut -d" " -f4 "/proc/$1/stat"; }\n'
        '  while cmp -s "/proc/$script/cmdline" "/proc/$(parent "$script")/cmdline"; do\n'
        '    script=$(parent "$script")\n'
        "  done\n"
        f'  touch {signalled} && kill -USR1 "$script" && sleep 1\n'
        "fi\n"
        f'exec {PYTHON} "$@"\n'
    )
    wrapper.chmod(0o755)
    steps = 80
    job = sbatch_job(
        slurm_cluster,
        directory,
        steps,
        "--time=5",
        env={"TXL_PYTHON": str(wrapper), "TXL_MAX_RELAUNCHES": "0"},
        extra=("train.stall_timeout=20",),
    )
    running_at_step(slurm_cluster, job, directory, 60)  # past the checkpoint of step 50
    lost = slurm_cluster.nodes[1]
    slurm_cluster.kill_node(lost)
    try:
        deadline = time.monotonic() + 120
        while "requeueing job" not in job_output(directory) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        slurm_cluster.restart_node(lost)
        slurm_cluster.resume_node(lost)
    assert slurm_cluster.wait_job(job, "COMPLETED", timeout=240) == "COMPLETED", job_output(directory)[-3000:]
    out = job_output(directory)
    first, _, second = out.partition("(restart 1)")
    assert signalled.exists() and second, out[-3000:]
    assert "TXL_MAX_RELAUNCHES=0: requeueing the job" in first and "time limit near" in first, first[-3000:]
    assert first.count("requeueing job") == 1 and "relaunching" not in first, first[-3000:]
    assert re.search(r"resumed from \S+step00000050 at step 50 \(exact", second), second[-3000:]
    assert_same_losses(directory / "run", reference, steps)
