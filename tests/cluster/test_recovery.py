"""Fast recovery on the test cluster (issue 37): what a fault costs when the ranks, not Slurm, say what happened.

A rank killed on a healthy node is relaunched on the same nodes; a node whose ranks stop answering is left out at
once, with Slurm's SlurmdTimeout at its default of 300 s; a spare node takes a lost node's place so that the run
stays identical to the uninterrupted one; a failure that comes back at the same step ends the job in one line.
Each test prints the seconds from the fault until training is past the lost step (docs/clusters.md quotes them).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.runs import (
    PYTHON,
    assert_identical_run,
    assert_same_run,
    fresh,
    job_output,
    running_at_step,
    sbatch_job,
    train_step_calls,
    wait_for_logged_step,
)
from tests.launcher import records

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("slurm_cluster")]

SLURM_DEFAULT_SLURMD_TIMEOUT = 300
K = 5
"""checkpoint.memory_every where a test takes memory snapshots: a fault costs at most this many steps (and the one
in flight)."""


def _assert_restored_from_memory(out: str, lost_at: int, held_on: str) -> None:
    """The relaunch resumed from a memory snapshot at most K + 1 steps before LOST_AT (the newest that every rank
    left; one being written when the fault came is not whole), held on the nodes HELD_ON."""
    restored = re.search(rf"restored step (\d+) from the memory snapshots of 2 rank\(s\) \(held on {held_on}\)", out)
    assert restored, out[-3000:]
    step = int(restored.group(1))
    assert step % K == 0 and 50 < step and lost_at - step <= K + 1, (step, lost_at)
    assert re.search(rf"resumed from \S+step{step:08d} at step {step} \(exact", out), out[-3000:]


def _back_past(directory: Path, lost_at: int, began: float, timeout: float = 240) -> float:
    """Seconds from BEGAN (the fault) until the resumed run logged a step past LOST_AT (metrics.jsonl is rewound to
    the checkpoint on resume, so a logged LOST_AT + 1 after a 'resumed from' line is new work)."""
    deadline = began + timeout
    while time.monotonic() < deadline:
        if "resumed from" in job_output(directory):
            logged = records(directory / "run")
            if logged and max(logged) > lost_at:
                return time.monotonic() - began
        time.sleep(0.25)
    pytest.fail(f"not back past step {lost_at} within {timeout} s:\n{job_output(directory)[-3000:]}")


def test_a_rank_killed_on_a_healthy_node_is_relaunched_on_the_same_nodes(slurm_cluster, shared, reference_run):
    """kill -9 of rank 1 (as the OOM killer does), its node healthy: the same job starts the step again on both
    nodes, which resume from the newest memory snapshot (checkpoint.memory_every=5: at most 5 steps back, not
    from the step-50 checkpoint) at the same world size and finish with exactly the uninterrupted run's losses
    and data. Submitted with the cluster's defaults (DefMemPerCPU). Before, the job ended ("not a lost node, so
    no relaunch")."""
    directory = fresh(shared, "rankkill")
    steps = 100
    job = sbatch_job(slurm_cluster, directory, steps, "--time=5", extra=(f"checkpoint.memory_every={K}",), memory=())
    running_at_step(slurm_cluster, job, directory, 60)
    lost_at = max(records(directory / "run"))
    began = time.monotonic()
    os.kill(slurm_cluster.rank_pid(job, slurm_cluster.nodes[1]), signal.SIGKILL)
    print(f"rank killed at step {lost_at}: back past it after {_back_past(directory, lost_at, began):.0f} s")
    assert slurm_cluster.wait_job(job, timeout=180) == "COMPLETED", job_output(directory)[-3000:]
    out = job_output(directory)
    assert re.search(
        r"the training step failed at step \d+ on nodes that are healthy \(txlnode1 \w+, txlnode2 \w+\): rank 1 "
        r"\(txlnode2\) at step \d+: train\.py: error: rank 1 \(txlnode2, PID \d+\) died",
        out,
    ), out[-3000:]
    assert "relaunch 1 of 3 (TXL_MAX_RELAUNCHES) on the same nodes: world 2 as before" in out, out[-3000:]
    # Both nodes hold every part (each its own, and the ring's copy of the other's): either may write it back.
    _assert_restored_from_memory(out, lost_at, held_on="(txlnode1|txlnode2|txlnode1, txlnode2)")
    assert train_step_calls(out) == 2 and "requeue" not in out, out[-3000:]
    assert [record["JobState"] for record in slurm_cluster.job_history(job)] == ["COMPLETED"]
    assert_identical_run(directory / "run", reference_run, steps)


def test_a_lost_node_is_left_out_long_before_slurms_node_timeout(slurm_cluster, shared, reference_run):
    """SlurmdTimeout at Slurm's default, 300 s: the second node dies (its processes, its memory and its link) at
    step 60. The rank left names it within seconds, the script ends the step itself, finds that no step runs on
    that node and relaunches on the first node alone, which resumes from the newest memory snapshot: its own part
    and the copy of the dead node's part that the ring left in its memory. Training is past the lost step long
    before Slurm would mark the node DOWN. Submitted with --mem-per-cpu: the failed step, still RUNNING for
    Slurm, holds the job's memory."""
    directory = fresh(shared, "nodetimeout")
    steps = 100
    lost = slurm_cluster.nodes[1]
    with slurm_cluster.slurmd_timeout(SLURM_DEFAULT_SLURMD_TIMEOUT):
        job = sbatch_job(
            slurm_cluster,
            directory,
            steps,
            "--time=10",
            extra=("train.stall_timeout=20", f"checkpoint.memory_every={K}"),
            memory=("--mem-per-cpu=1500",),
        )
        running_at_step(slurm_cluster, job, directory, 60)
        lost_at = max(records(directory / "run"))
        began = time.monotonic()
        slurm_cluster.kill_node(lost)
        slurm_cluster.disconnect_node(lost)
        try:
            back = _back_past(directory, lost_at, began)
            print(f"node lost at step {lost_at} (SlurmdTimeout=300): back past it after {back:.0f} s")
            state = slurm_cluster.node_info(lost).get("State", "")
            wait_for_logged_step(directory / "run", steps, timeout=240)
        finally:
            # The finished job waits for the dead node until Slurm marks it DOWN: bring it back, as a repaired node.
            slurm_cluster.reconnect_node(lost)
            slurm_cluster.restart_node(lost)
            slurm_cluster.resume_node(lost)
        assert slurm_cluster.wait_job(job, timeout=120) == "COMPLETED", job_output(directory)[-3000:]
    out = job_output(directory)
    assert back < SLURM_DEFAULT_SLURMD_TIMEOUT / 2, (back, out[-3000:])
    assert "DOWN" not in state, state  # Slurm had not noticed yet when training was back
    assert re.search(rf"lost {lost} \(named by the ranks", out), out[-3000:]
    assert re.search(r"relaunch 1 of 3 .* on txlnode1: world 2 -> 1 rank\(s\)", out), out[-3000:]
    # Rank 1's part of the snapshot lived on in txlnode1's memory: the ring's copy of txlnode2's.
    _assert_restored_from_memory(out, lost_at, held_on="txlnode1")
    assert "requeue" not in out, out[-3000:]
    assert_same_run(directory / "run", reference_run, steps)


def test_a_spare_node_takes_the_place_of_a_lost_one_and_the_run_stays_identical(slurm_cluster, shared, reference_run):
    """sbatch --nodes 3 with TXL_SPARE_NODES=1: two nodes train, the third waits. The second node dies at step 60;
    the spare takes its place, the world stays 2 ranks with the same micro-batches, and the run ends with exactly
    the uninterrupted run's losses and data. Its checkpoints are written in the background
    (checkpoint.background): the resume from the one of step 50 is exact all the same. Submitted with --mem."""
    directory = fresh(shared, "spare")
    steps = 100
    lost, spare = slurm_cluster.all_nodes[1], slurm_cluster.all_nodes[2]
    with slurm_cluster.slurmd_timeout(SLURM_DEFAULT_SLURMD_TIMEOUT):
        job = sbatch_job(
            slurm_cluster,
            directory,
            steps,
            "--time=10",
            f"--partition={slurm_cluster.spare_partition}",
            extra=("train.stall_timeout=20", "checkpoint.background=true"),
            env={"TXL_SPARE_NODES": "1"},
            memory=("--mem=1500",),
            nodes=3,
        )
        running_at_step(slurm_cluster, job, directory, 60)
        lost_at = max(records(directory / "run"))
        began = time.monotonic()
        slurm_cluster.kill_node(lost)
        try:
            back = _back_past(directory, lost_at, began)
            print(f"node lost at step {lost_at}, spare taken: back past it after {back:.0f} s")
            wait_for_logged_step(directory / "run", steps, timeout=240)
        finally:
            slurm_cluster.restart_node(lost)
            slurm_cluster.resume_node(lost)
        assert slurm_cluster.wait_job(job, timeout=120) == "COMPLETED", job_output(directory)[-3000:]
    out = job_output(directory)
    assert f"slurm.sbatch: spare {spare} takes the place of {lost}: the world keeps its size" in out, out[-3000:]
    assert re.search(
        rf"relaunch 1 of 3 \(TXL_MAX_RELAUNCHES\) on txlnode1,{spare}: world 2 -> 2 rank\(s\), the same micro-batches",
        out,
    ), out[-3000:]
    assert re.search(r"ranks' environment: .* on txlnode1, txlnode3", out), out[-3000:]
    assert re.search(r"resumed from \S+step00000050 at step 50 \(exact", out), out[-3000:]
    assert "writing it in the background" in out and "complete at step" in out, out[-3000:]
    assert_identical_run(directory / "run", reference_run, steps)


def test_a_failure_repeated_at_the_same_step_ends_the_job_in_one_line(slurm_cluster, shared):
    """Rank 1 dies whenever the run reaches step 60 (SIGKILL as its training loop finishes step 60, as a fault in
    the data or the code would): relaunched once on the same nodes, it dies at step 60 again, and the job ends with
    one line naming the step, the rank and its error, without a third step and without a requeue. Submitted with
    --mem=0."""
    directory = fresh(shared, "repeated")
    # The fault is exact, not a watcher's poll of the log (a poll lands a step or two late on a loaded machine, and
    # two landings further apart than the decision's slack are rightly two different failures): a sitecustomize on
    # rank 1's PYTHONPATH kills the process as the loop reports step 60 done, in every launch.
    inject = directory / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os, signal\n"
        "from txl_dist.supervision.guard import RunGuard\n"
        "reported = RunGuard.progress\n"
        "def progress(self, step):\n"
        "    reported(self, step)\n"
        "    if step == 60:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "RunGuard.progress = progress\n"
    )
    wrapper = directory / "python"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'if [ "$2" != launchers/train.py ] || [ "${{SLURM_PROCID:-0}}" != 1 ]; then exec {PYTHON} "$@"; fi\n'
        f'PYTHONPATH="{inject}${{PYTHONPATH:+:$PYTHONPATH}}" exec {PYTHON} "$@"\n'
    )
    wrapper.chmod(0o755)
    job = sbatch_job(slurm_cluster, directory, 100, "--time=5", env={"TXL_PYTHON": str(wrapper)}, memory=("--mem=0",))
    state = slurm_cluster.wait_job(job, timeout=240)
    out = job_output(directory)
    assert state == "FAILED", (state, out[-3000:])
    came_back = [line for line in out.splitlines() if "came back" in line]
    assert len(came_back) == 1 and re.match(
        r"slurm\.sbatch: the failure came back at step 60 after a relaunch \(rank 1 \(txlnode2\) at step 60: "
        r"train\.py: error: rank 1 \(txlnode2, PID \d+\) died",
        came_back[0],
    ), out[-3000:]
    assert train_step_calls(out) == 2 and "requeue" not in out, out[-3000:]
