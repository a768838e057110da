"""txl_dist.world.slurm_nodes: what launchers/slurm.sbatch does after a failed training step, from Slurm's view of the
job's nodes and the run's own progress (its reading of a real Slurm is tested on the two-node cluster:
tests/cluster/test_cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from txl_dist.world import slurm_nodes
from txl_dist.world.slurm_nodes import Limits, Situation, decide

NODES = ["n1", "n2", "n3", "n4"]
DEFAULTS = Limits()


def situation(states: dict[str, str], job_nodes=None, relaunches=0, requeueable=False, ranks_per_node=1):
    return Situation(
        step_nodes=NODES,
        job_nodes=list(states) if job_nodes is None else job_nodes,
        states=states,
        batch_host="n1",
        ranks_per_node=ranks_per_node,
        relaunches=relaunches,
        requeueable=requeueable,
    )


def healthy(*down: str) -> dict[str, str]:
    return {node: ("DOWN+NOT_RESPONDING" if node in down else "ALLOCATED") for node in NODES}


def run_decide(case: Situation, limits=DEFAULTS, holds=lambda world: True, progress=(63, 50)):
    said: list[str] = []
    return decide(case, limits, holds, progress, said.append), said


def test_a_node_removed_from_the_job_is_lost_and_the_step_goes_on_without_it():
    states = healthy("n3")
    decision, said = run_decide(situation(states, job_nodes=["n1", "n2", "n4"]))
    assert decision == "relaunch 3 n1,n2,n4"
    assert said[0] == (
        "lost n3 (removed from the job by Slurm, State=DOWN+NOT_RESPONDING) at step 63; newest checkpoint: "
        "checkpoint step 50"
    )
    assert said[-1] == (
        "relaunch 1 of 3 (TXL_MAX_RELAUNCHES) on n1,n2,n4: world 4 -> 3 rank(s), the same global batch; resuming "
        "from checkpoint step 50, 13 step(s) recomputed"
    )


@pytest.mark.parametrize("state", ["IDLE+DRAIN", "MIXED+DRAIN", "DOWN", "idle*", "FAIL", "POWERED_DOWN", "FUTURE"])
def test_a_node_still_in_the_job_but_unusable_is_lost(state):
    states = {**healthy(), "n2": state}
    decision, said = run_decide(situation(states))
    assert decision == "relaunch 3 n1,n3,n4", said
    assert said[0].startswith(f"lost n2 (State={state})")


def test_a_failure_on_healthy_nodes_is_not_a_lost_node():
    decision, said = run_decide(situation(healthy()))
    assert decision == "end"
    assert said == [
        "the training step failed on nodes that Slurm reports healthy (n1 ALLOCATED, n2 ALLOCATED, n3 ALLOCATED, "
        "n4 ALLOCATED): not a lost node, so no relaunch"
    ]


@pytest.mark.parametrize("requeueable, expected", [(False, "end"), (True, "requeue")])
def test_below_the_floor_the_job_ends_or_goes_back_to_the_queue(requeueable, expected):
    decision, said = run_decide(situation(healthy("n2", "n4"), requeueable=requeueable), Limits(min_nodes=3))
    assert decision == expected
    resumes = "its next run resumes" if requeueable else "the same command resumes"
    assert said[-1].startswith("2 node(s) left, fewer than TXL_MIN_NODES=3: ") and resumes in said[-1], said


def test_past_the_bound_the_job_ends():
    decision, said = run_decide(situation(healthy("n4"), relaunches=2), Limits(max_relaunches=2))
    assert decision == "end"
    assert said[-1].startswith("2 relaunch(es) in this job already, TXL_MAX_RELAUNCHES=2: ending the job"), said
    assert run_decide(situation(healthy("n4"), relaunches=1), Limits(max_relaunches=2))[0] == "relaunch 3 n1,n2,n3"


def test_the_world_is_the_largest_that_holds_the_global_batch(tmp_path):
    """configs/tiny_cpu.yaml: global batch 8, micro-batch 2; 3 nodes of 1 rank cannot hold it, 2 can."""
    holds = slurm_nodes.batch_holds(["--config", "configs/tiny_cpu.yaml", f"train.output_dir={tmp_path}"], 4)
    assert [holds(world) for world in (4, 3, 2, 1)] == [True, False, True, True]
    decision, said = run_decide(situation(healthy("n2")), holds=holds)
    assert decision == "relaunch 2 n1,n3"
    assert "3 node(s) would not hold the global batch; using 2 of the 3 left" in said
    decision, said = run_decide(situation(healthy("n2")), Limits(min_nodes=3), holds=holds)
    assert decision == "end" and said[-1].startswith("the global batch does not split over 3 rank(s)"), said


def test_the_batch_host_stays_in_the_step_as_rank_0():
    case = Situation(NODES, NODES, healthy("n1"), "n3", 1, 0, False)
    decision, _ = run_decide(case, holds=lambda world: world != 3)
    assert decision == "relaunch 2 n3,n2"


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"TXL_MIN_NODES": "0"}, "TXL_MIN_NODES='0' is not allowed: a whole number of at least 1"),
        ({"TXL_MIN_NODES": "two"}, "TXL_MIN_NODES='two' is not allowed: a whole number of at least 1"),
        ({"TXL_MAX_RELAUNCHES": "-1"}, "TXL_MAX_RELAUNCHES='-1' is not allowed: a whole number of at least 0"),
        ({"TXL_MIN_NODES": "3"}, "TXL_MIN_NODES=3 is more than the job's 2 node(s)"),
    ],
)
def test_bad_limits_are_refused_in_one_line_at_the_start_of_the_job(environ, message, monkeypatch, capsys):
    for name in ("TXL_MIN_NODES", "TXL_MAX_RELAUNCHES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert slurm_nodes.main(["check", "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slurm.sbatch: error: {message}") and err.count("\n") == 1, err


def test_limits_default_to_a_floor_of_one_node_and_three_relaunches():
    assert slurm_nodes.read_limits({}, 2) == Limits(1, 3)
    assert slurm_nodes.read_limits({"TXL_MIN_NODES": "2", "TXL_MAX_RELAUNCHES": "0"}, 2) == Limits(2, 0)


def test_progress_is_the_newest_logged_step_and_the_newest_complete_checkpoint(tmp_path):
    assert slurm_nodes.run_progress(tmp_path) == (None, None)
    lines = [json.dumps({"kind": "train", "step": step}) for step in (61, 62)]
    lines.append(json.dumps({"kind": "eval", "step": 70}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "st')  # a line cut short
    for step, complete in ((40, True), (50, True), (60, False)):
        folder = tmp_path / "checkpoints" / f"step{step:08d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "COMPLETE.json").write_text("{}")
    (tmp_path / "checkpoints" / "step00000050_universal").mkdir()
    assert slurm_nodes.run_progress(tmp_path) == (62, 50)


def test_the_output_directory_is_read_as_the_ranks_read_it(tmp_path):
    """The file's value, then the command line's; train.py's other flags are no concern of this reading."""
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  output_dir: runs/a\n")
    args = ["--config", str(config), "--deepspeed_config", "x.json", "log.every=1"]
    assert slurm_nodes.output_dir_of(args) == Path("runs/a")
    assert slurm_nodes.output_dir_of([*args, "train.output_dir=/shared/b"]) == Path("/shared/b")
    assert slurm_nodes.output_dir_of(["log.every=1"]) is None
