"""Elastic runs on the two-node test cluster (tests/cluster/harness.py): a node lost mid-run costs a relaunch on
the node left, inside the same Slurm job (launchers/slurm.sbatch), or a restart of torchrun's elastic agent at
the new world size; a node that joins torchrun's rendezvous grows the world. Each run ends with the data checksums
and, within float tolerance, the losses of the uninterrupted 2-rank reference (another world sums the same
gradients in another order)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.cluster.runs import (
    CPU,
    assert_same_run,
    fresh,
    job_output,
    running_at_step,
    sbatch_job,
    train_args,
    wait_for_logged_step,
)
from tests.launcher import REPO, TORCHRUN, free_port, rank_processes, records

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("slurm_cluster")]


def _print_cost_of_the_loss(directory: Path, lost_at: int, timeout: float = 240) -> None:
    """Prints how long the job took, from the node's loss, to relaunch the step, to resume, and to be back at step
    LOST_AT (detection, restart, recomputation: the figures docs/recovery.md quotes). The resumed run rewinds
    metrics.jsonl to its checkpoint, so being back is a logged LOST_AT after the resume."""
    began = time.monotonic()
    marks: dict[str, float] = {}
    while time.monotonic() - began < timeout and "back" not in marks:
        out = job_output(directory)
        for mark, text in (("relaunched", "relaunching on"), ("resumed", "resumed from")):
            if mark not in marks and text in out:
                marks[mark] = time.monotonic() - began
        logged = records(directory / "run")
        if "resumed" in marks and logged and max(logged) >= lost_at:
            marks["back"] = time.monotonic() - began
        time.sleep(0.5)
    print(f"lost at step {lost_at}: " + ", ".join(f"{mark} after {seconds:.0f} s" for mark, seconds in marks.items()))


def test_a_lost_node_costs_a_relaunch_on_the_node_left_within_the_same_job(slurm_cluster, shared, reference_run):
    """The second node dies (every process of it, and its link) at step 60: the ranks name it (or Slurm marks it
    DOWN first), and the batch script starts the step again on the first node alone, inside the same allocation
    (--no-kill). The one rank resumes from the step-50 checkpoint with 4 accumulation steps instead of 2 and
    finishes the run: the same data in the same order (checksums equal) and the same losses within float
    tolerance, without a requeue. Submitted with the cluster's DefMemPerCPU: the failed step, still RUNNING in
    Slurm's books, held the memory that a relaunch with --overlap alone asked for ("Memory required by task is not
    available"), and the job ended. The relaunches of tests/cluster/test_recovery.py cover Slurm's other memory
    requests (--mem-per-cpu, --mem, --mem=0), one each."""
    directory = fresh(shared, "elastic")
    steps = 100
    job = sbatch_job(
        slurm_cluster,
        directory,
        steps,
        "--time=5",
        "--signal=B:USR1@10",
        extra=("train.stall_timeout=20",),
        memory=(),
    )
    running_at_step(slurm_cluster, job, directory, 60)  # past the checkpoint of step 50
    lost = slurm_cluster.nodes[1]
    slurm_cluster.kill_node(lost)
    slurm_cluster.disconnect_node(lost)  # a dead host: nothing of it runs, nothing reaches it
    try:
        _print_cost_of_the_loss(directory, max(records(directory / "run")))
        wait_for_logged_step(directory / "run", steps, timeout=240)
        state = slurm_cluster.wait_job(job, timeout=60)
    finally:
        slurm_cluster.reconnect_node(lost)
        slurm_cluster.restart_node(lost)
        slurm_cluster.resume_node(lost)
    out = job_output(directory)
    assert state == "COMPLETED", (state, out[-3000:])
    # Named by the ranks (and no step runs there), or NOT_RESPONDING or DOWN for Slurm (SlurmdTimeout=20 here),
    # whichever comes first.
    lost_at = re.search(
        rf"slurm.sbatch: lost {lost} \((named by the ranks|.*NOT_RESPONDING|.*DOWN).*\) at step (\d+); newest "
        r"checkpoint: checkpoint step 50",
        out,
    )
    assert lost_at and int(lost_at.group(2)) >= 60, out[-3000:]
    recomputed = int(lost_at.group(2)) - 50
    assert re.search(
        r"relaunch 1 of 3 .* on txlnode1: world 2 -> 1 rank\(s\).*"
        rf"resuming from checkpoint step 50, {recomputed} step\(s\) recomputed",
        out,
    ), out[-3000:]
    assert re.search(r"resumed from \S+step00000050 at step 50 \(exact", out), out[-3000:]
    assert "restart 1" not in out and "requeue" not in out, out[-3000:]
    # One run of the job: its end, after Slurm's record of the node's removal (RESIZING) when Slurm marked the node
    # DOWN before the job ended; a requeue would add a run.
    states = [record["JobState"] for record in slurm_cluster.job_history(job)]
    assert [state for state in states if state != "RESIZING"] == ["COMPLETED"], states
    assert_same_run(directory / "run", reference_run, steps)


def test_a_bad_relaunch_limit_stops_the_job_before_training(slurm_cluster, shared):
    directory = fresh(shared, "badlimit")
    job = sbatch_job(slurm_cluster, directory, 10, "--time=5", env={"TXL_MAX_RELAUNCHES": "three"})
    assert slurm_cluster.wait_job(job, timeout=60) == "FAILED"
    out = job_output(directory)
    errors = [line for line in out.splitlines() if "error" in line]
    assert errors == ["slurm.sbatch: error: TXL_MAX_RELAUNCHES='three' is not allowed: a whole number of at least 0"], (
        out[-3000:]
    )
    assert "ranks' environment" not in out and not (directory / "run").exists(), out[-3000:]
    assert slurm_cluster.job_history(job)[-1]["ExitCode"] == "2:0"


# ---- torchrun's elastic agent ------------------------------------------------------------------------------------

TORCHRUN_STEPS = 100
# The rendezvous completes 5 s after its first MIN nodes joined (torch's default, 30 s, only makes a test slower).
RDZV_CONF = "last_call_timeout=5"
# torch 2.13's agents share the rendezvous store with the workers by default; then an agent that stays rank 0 when
# a node joins does not publish the new round's MASTER_ADDR, and the joining agent times out waiting for it
# (`wait timeout after 60000ms, keys: /torch.rendezvous.RUN.1/MASTER_ADDR`). With the sharing off, rank 0's worker
# hosts the workers' store each round, as before torch 2.4.
AGENT_ENV = {**CPU, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _elastic_torchrun(cluster, node: str, directory: Path, port: int) -> subprocess.Popen:
    """`torchrun --nnodes 1:2 --rdzv-backend c10d` on NODE, as docs/clusters.md shows it, its output in a file of
    DIRECTORY; the rendezvous store on the first node."""
    log = open(directory / f"torchrun-{node}.log", "ab")
    try:
        return cluster.popen_on(
            node,
            [
                TORCHRUN,
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "1",
                "--max-restarts",
                "3",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{cluster.nodes[0]}:{port}",
                "--rdzv-id",
                directory.name,
                "--rdzv-conf",
                RDZV_CONF,
                "launchers/train.py",
                *train_args(directory.parent / "shards", directory / "run", TORCHRUN_STEPS),
            ],
            env=AGENT_ENV,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


def _agent_output(directory: Path) -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted(directory.glob("torchrun-*.log")))


def _finished(process: subprocess.Popen, directory: Path, timeout: float) -> str:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"torchrun still ran after {timeout} s:\n{_agent_output(directory)[-4000:]}")
    out = _agent_output(directory)
    assert process.returncode == 0, out[-4000:]
    return out


def test_torchrun_elastic_goes_on_at_world_1_when_the_other_node_dies(slurm_cluster, shared, reference_run):
    """Both agents form a world of 2; at step 60 the second node dies with its agent and rank. The first rank
    names it and exits 1; its agent (a restart left of --max-restarts) meets the rendezvous alone, restarts the
    worker at world 1, which resumes from the step-50 checkpoint and finishes: exit 0, the reference's data and
    losses."""
    directory = fresh(shared, "torchrun-shrink")
    port = free_port()
    first = _elastic_torchrun(slurm_cluster, slurm_cluster.nodes[0], directory, port)
    try:
        _elastic_torchrun(slurm_cluster, slurm_cluster.nodes[1], directory, port)
        wait_for_logged_step(directory / "run", 60)
        slurm_cluster.kill_node(slurm_cluster.nodes[1])
        out = _finished(first, directory, timeout=240)
    finally:
        first.kill()
        slurm_cluster.restart_node(slurm_cluster.nodes[1])
        slurm_cluster.resume_node(slurm_cluster.nodes[1])
    named = [line for line in out.splitlines() if line.startswith("train.py: error")]
    assert named and f"rank 1 ({slurm_cluster.nodes[1]}" in named[0], out[-4000:]
    assert re.search(r"on 1 rank\(s\): global batch 8 = 1 ranks x micro-batch 2 x 4 accumulation", out), out[-4000:]
    assert re.search(r"resumed from \S+step00000050 at step 50 \(exact", out), out[-4000:]
    assert_same_run(directory / "run", reference_run, TORCHRUN_STEPS)


def test_torchrun_elastic_grows_to_world_2_when_a_node_joins(slurm_cluster, shared, reference_run):
    """The first agent trains alone (world 1, 4 accumulation steps); a second agent started later joins the
    rendezvous, the first agent stops its worker (SIGTERM: a checkpoint at the step it was at) and both start at
    world 2 from that checkpoint. Membership changes do not use up --max-restarts; the run ends with the
    reference's data and losses. The lone worker waits (SIGSTOP) from step 20 until its agent stops it, so that
    it cannot finish the run before the second agent has started."""
    directory = fresh(shared, "torchrun-grow")
    port = free_port()
    first = _elastic_torchrun(slurm_cluster, slurm_cluster.nodes[0], directory, port)
    second = None
    try:
        wait_for_logged_step(directory / "run", 20)
        worker = rank_processes(first)[0]
        worker.suspend()
        second = _elastic_torchrun(slurm_cluster, slurm_cluster.nodes[1], directory, port)
        deadline = time.monotonic() + 120
        while "closing signal SIGTERM" not in _agent_output(directory) and time.monotonic() < deadline:
            time.sleep(0.2)
        worker.resume()
        out = _finished(first, directory, timeout=240)
        _finished(second, directory, timeout=60)
    finally:
        for process in (first, second):
            if process is not None:
                process.kill()
    assert "on 1 rank(s)" in out and "on 2 rank(s)" in out, out[-4000:]
    stopped = re.search(r"done: (\d+) steps \(\d+ this run\) in [0-9.]+ s, [0-9]+ tokens/s, stopped by SIGTERM", out)
    assert stopped and 20 <= int(stopped.group(1)) < TORCHRUN_STEPS, out[-4000:]
    assert re.search(rf"resumed from \S+ at step {stopped.group(1)} \(exact", out), out[-4000:]
    assert_same_run(directory / "run", reference_run, TORCHRUN_STEPS)
