"""txl_dist.supervision.slurm_nodes: what launchers/slurm.sbatch does after a failed training step, from Slurm's view of
the job's nodes and the run's own progress (its reading of a real Slurm is tested on the two-node cluster:
tests/cluster/test_cluster.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests import fake_slurm
from tests.launcher import REPO
from txl_dist.supervision import run_progress, slurm_nodes, slurm_view
from txl_dist.supervision.relaunch import Limits, Situation, decide, read_limits

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


def run_decide(case: Situation, limits=DEFAULTS, fits=lambda world: True, progress=(63, 50)):
    said: list[str] = []
    return decide(case, limits, fits, progress, said.append), said


def test_a_node_removed_from_the_job_is_lost_and_the_step_goes_on_without_it():
    states = healthy("n3")
    decision, said = run_decide(situation(states, job_nodes=["n1", "n2", "n4"]))
    assert decision == "relaunch 3 n1,n2,n4 -"
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
    assert decision == "relaunch 3 n1,n3,n4 -", said
    assert said[0].startswith(f"lost n2 (State={state})")


def fault(kind: str, rank: int, host: str | None, step: int | None = 61, message: str = "", **more) -> dict:
    """A rank's record in the fault log, as txl_dist.supervision.guard writes it."""
    text = message or f"train.py: error: rank {rank} ({host}) {kind}"
    return {"kind": kind, "rank": rank, "host": host, "step": step, "message": text, "world_size": 4, **more}


def test_a_failure_on_healthy_nodes_is_retried_on_the_same_nodes():
    """A rank that failed while every node is healthy (the OOM killer, a crash): the same nodes again, so the world
    and the run stay those of the uninterrupted run. Before, the job ended."""
    error = fault("error", 2, "n3", message="train.py: error on rank 2 (n3): [Errno 5] Input/output error")
    case = situation(healthy(), requeueable=True)
    decision, said = run_decide(Situation(**{**case.__dict__, "failures": [error]}))
    assert decision == "relaunch 4 n1,n2,n3,n4 -"
    assert said == [
        "the training step failed at step 63 on nodes that are healthy (n1 ALLOCATED, n2 ALLOCATED, n3 ALLOCATED, "
        "n4 ALLOCATED): rank 2 (n3) at step 61: train.py: error on rank 2 (n3): [Errno 5] Input/output error; "
        "relaunch 1 of 3 (TXL_MAX_RELAUNCHES) on the same nodes: world 4 as before; resuming from checkpoint step "
        "50, 13 step(s) recomputed"
    ]


@pytest.mark.parametrize(
    "changes",
    [{"status": 2}, {"failures": [fault("refused", 0, "n1", message="train.py: error: data.shards: no manifest")]}],
    ids=["exit-2", "refused-record"],
)
def test_a_rank_that_refused_its_input_is_never_retried(changes):
    decision, said = run_decide(replace(situation(healthy(), requeueable=True), **changes))
    assert decision == "end" and len(said) == 1, said
    assert said[0].startswith("a rank refused its input (") and "so the job ends" in said[0], said


@pytest.mark.parametrize(
    "changes",
    [
        {"status": 4},
        {"failures": [fault("numerics", 0, "n1", message="train.py: error: numerical fault at step 61: the loss")]},
    ],
    ids=["exit-4", "numerics-record"],
)
@pytest.mark.parametrize("lost", [(), ("n3",)], ids=["healthy-nodes", "a-node-lost"])
def test_a_run_stopped_by_its_own_numbers_is_never_retried_even_beside_a_lost_node(changes, lost):
    """A relaunch would meet the same fault, whatever the nodes: the job ends, neither relaunched on the nodes left
    nor requeued (a refused input likewise, which was relaunched before when a node was lost too)."""
    decision, said = run_decide(replace(situation(healthy(*lost), requeueable=True), **changes))
    assert decision == "end" and len(said) == 1, said
    assert said[0].startswith("the run stopped on its own numbers (") and "the newest healthy checkpoint" in said[0]
    refused = fault("refused", 0, "n1", message="train.py: error: data.shards: no manifest")
    decision, said = run_decide(replace(situation(healthy(*lost), requeueable=True), failures=[refused]))
    assert decision == "end" and said[0].startswith("a rank refused its input ("), said


def test_a_failure_that_comes_back_at_the_same_step_ends_the_job_in_one_line():
    """Relaunched once after a failure at step 61, the run fails at step 61 again: the job ends with one line
    naming the step, the rank and its error, instead of relaunching (or requeueing) into the same failure."""
    error = fault("died", 1, "n2", message="train.py: error: rank 1 (n2, PID 9) died without reporting an error")
    case = replace(situation(healthy(), relaunches=1, requeueable=True), failures=[error], previous_failure=61)
    decision, said = run_decide(case)
    assert decision == "end"
    assert said == [
        "the failure came back at step 61 after a relaunch (rank 1 (n2) at step 61: train.py: error: rank 1 (n2, "
        "PID 9) died without reporting an error): not retrying it again, the job ends; the same command resumes "
        "from the newest checkpoint once the cause is fixed"
    ]
    assert run_decide(replace(case, previous_failure=59))[0] == "relaunch 4 n1,n2,n3,n4 -"
    # The rank that reports a death may stand one step past the dead rank: still the same fault.
    assert run_decide(replace(case, previous_failure=60))[0] == "end"
    # Without a record of the ranks, the step reached (the log and the checkpoints) tells.
    assert run_decide(replace(case, failures=[], previous_failure=63))[0] == "end"


def test_failures_on_healthy_nodes_past_the_bound_end_the_job():
    decision, said = run_decide(replace(situation(healthy(), relaunches=3, requeueable=True)))
    assert decision == "end"
    assert said[-1].endswith("after 3 relaunch(es) in this job, TXL_MAX_RELAUNCHES=3: the job ends"), said


def test_a_rank_named_stalled_leaves_its_node_out_whatever_slurm_says():
    """Slurm still calls n2 ALLOCATED (it would mark it DOWN after SlurmdTimeout, 300 s by default): the ranks'
    word is enough to leave it out at once."""
    stalled = fault("stalled", 1, "n2", message="train.py: error: rank 1 (n2, PID 7) has made no progress for 20 s")
    named = slurm_view.named_by_the_ranks([stalled], NODES, 1, answers=lambda node: pytest.fail("no probe"))
    assert named == {"n2": "named by the ranks: rank 1 (n2) at step 61: " + stalled["message"]}
    decision, said = run_decide(replace(situation(healthy()), failures=[stalled], named=named))
    assert decision == "relaunch 3 n1,n3,n4 -"
    assert said[0].startswith("lost n2 (named by the ranks: rank 1 (n2) at step 61: ") and "at step 63;" in said[0]


def test_a_dead_rank_costs_its_node_only_when_slurm_cannot_run_a_step_there():
    died = fault("died", 2, "n3.cluster.example", message="train.py: error: rank 2 (n3) died")
    asked = []

    def answers(node):
        asked.append(node)
        return None if node == "n3" else "no answer"

    assert slurm_view.named_by_the_ranks([died], NODES, 1, answers) == {} and asked == ["n3"]
    named = slurm_view.named_by_the_ranks([died], NODES, 1, lambda node: "srun failed (exit 1): refused")
    assert named == {"n3": "named by the ranks and no step runs there: srun failed (exit 1): refused"}


def test_a_rank_whose_host_is_unknown_is_placed_by_slurms_block_distribution():
    """The rank that died was rank 0, whose identity went with the rendezvous store: rank 5 of 8 ranks on 4 nodes
    runs on the third."""
    assert slurm_view.node_of({"rank": 5, "host": None, "world_size": 8}, NODES, 2) == "n3"
    assert slurm_view.node_of({"rank": 5, "host": None, "world_size": 6}, NODES, 2) is None  # another world
    assert slurm_view.node_of({"rank": 0, "host": "elsewhere", "world_size": 3}, NODES, 1) is None


def spares_case(states: dict[str, str], spares=("n5", "n6"), job_nodes=None) -> Situation:
    job = list(NODES) + list(spares) if job_nodes is None else job_nodes
    return replace(situation({**states}, job_nodes=job), spares=list(spares))


def test_a_spare_takes_the_place_of_a_lost_node_and_the_world_keeps_its_size():
    states = {**healthy("n2"), "n5": "IDLE", "n6": "IDLE"}
    decision, said = run_decide(spares_case(states))
    assert decision == "relaunch 4 n1,n5,n3,n4 n6"
    assert "spare n5 takes the place of n2: the world keeps its size" in said
    assert said[-1].startswith(
        "relaunch 1 of 3 (TXL_MAX_RELAUNCHES) on n1,n5,n3,n4: world 4 -> 4 rank(s), the same micro-batches"
    )


def test_an_unusable_spare_is_dropped_and_without_spares_the_world_shrinks():
    states = {**healthy("n2", "n4"), "n5": "IDLE+DRAIN", "n6": "IDLE"}
    decision, said = run_decide(spares_case(states))
    assert decision == "relaunch 3 n1,n6,n3 -"
    assert "spare n5 is not usable (State=IDLE+DRAIN): dropped" in said
    assert "spare n6 takes the place of n2: the world keeps its size" in said
    assert said[-1].startswith(
        "relaunch 1 of 3 (TXL_MAX_RELAUNCHES) on n1,n6,n3: world 4 -> 3 rank(s), the same global batch"
    )


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
    assert run_decide(situation(healthy("n4"), relaunches=1), Limits(max_relaunches=2))[0] == "relaunch 3 n1,n2,n3 -"


def test_the_world_is_the_largest_that_holds_the_global_batch(tmp_path):
    """configs/tiny_cpu.yaml: global batch 8, micro-batch 2; 3 nodes of 1 rank cannot hold it, 2 can."""
    fits = run_progress.global_batch_fits(["--config", "configs/tiny_cpu.yaml", f"train.output_dir={tmp_path}"], 4)
    assert [fits(world) for world in (4, 3, 2, 1)] == [True, False, True, True]
    decision, said = run_decide(situation(healthy("n2")), fits=fits)
    assert decision == "relaunch 2 n1,n3 -"
    assert "3 node(s) would not hold the global batch; using 2 of the 3 left" in said
    decision, said = run_decide(situation(healthy("n2")), Limits(min_nodes=3), fits=fits)
    assert decision == "end" and said[-1].startswith("the global batch does not split over 3 rank(s)"), said


def test_the_batch_host_stays_in_the_step_as_rank_0():
    case = Situation(NODES, NODES, healthy("n1"), "n3", 1, 0, False)
    decision, _ = run_decide(case, fits=lambda world: world != 3)
    assert decision == "relaunch 2 n3,n2 -"


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"TXL_MIN_NODES": "0"}, "TXL_MIN_NODES='0' is not allowed: a whole number of at least 1"),
        ({"TXL_MIN_NODES": "two"}, "TXL_MIN_NODES='two' is not allowed: a whole number of at least 1"),
        ({"TXL_MAX_RELAUNCHES": "-1"}, "TXL_MAX_RELAUNCHES='-1' is not allowed: a whole number of at least 0"),
        ({"TXL_MIN_NODES": "3"}, "TXL_MIN_NODES=3 is more than the job's 2 node(s)"),
        ({"TXL_SPARE_NODES": "x"}, "TXL_SPARE_NODES='x' is not allowed: a whole number of at least 0"),
        (
            {"TXL_SPARE_NODES": "2"},
            "TXL_SPARE_NODES=2 leaves 0 of the job's 2 node(s) to train on, fewer than TXL_MIN_NODES=1; allowed: 0 "
            "to 1",
        ),
        (
            {"TXL_SPARE_NODES": "1", "TXL_MIN_NODES": "2"},
            "TXL_SPARE_NODES=1 leaves 1 of the job's 2 node(s) to train on, fewer than TXL_MIN_NODES=2; allowed: 0 "
            "to 0",
        ),
    ],
)
def test_bad_limits_are_refused_in_one_line_at_the_start_of_the_job(environ, message, monkeypatch, capsys):
    for name in ("TXL_MIN_NODES", "TXL_MAX_RELAUNCHES", "TXL_SPARE_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert slurm_nodes.main(["check", "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slurm.sbatch: error: {message}") and err.count("\n") == 1, err


def test_limits_default_to_a_floor_of_one_node_and_three_relaunches():
    assert read_limits({}, 2) == Limits(1, 3, 0)
    assert read_limits({"TXL_SPARE_NODES": " 1 "}, 3) == Limits(1, 3, 1)
    assert read_limits({"TXL_MIN_NODES": "2", "TXL_MAX_RELAUNCHES": "0"}, 2) == Limits(2, 0)


def test_progress_is_the_newest_logged_step_and_the_newest_complete_checkpoint(tmp_path):
    assert run_progress.run_progress(tmp_path) == (None, None)
    lines = [json.dumps({"kind": "train", "step": step}) for step in (61, 62)]
    lines.append(json.dumps({"kind": "eval", "step": 70}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "st')  # a line cut short
    for step, complete in ((40, True), (50, True), (60, False)):
        folder = tmp_path / "checkpoints" / f"step{step:08d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / "COMPLETE.json").write_text("{}")
    (tmp_path / "checkpoints" / "step00000050_universal").mkdir()
    assert run_progress.run_progress(tmp_path) == (62, 50)


def test_the_output_directory_is_read_as_the_ranks_read_it(tmp_path):
    """The file's value, then the command line's; train.py's other flags are no concern of this reading."""
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  output_dir: runs/a\n")
    args = ["--config", str(config), "--deepspeed_config", "x.json", "log.every=1"]
    assert run_progress.output_dir_of(args) == Path("runs/a")
    assert run_progress.output_dir_of([*args, "train.output_dir=/shared/b"]) == Path("/shared/b")
    assert run_progress.output_dir_of(["log.every=1"]) is None


# ---- the run's log and checkpoints ------------------------------------------------------------------------------


def _checkpoint(run: Path, step: int) -> None:
    folder = run / "checkpoints" / f"step{step:08d}"
    folder.mkdir(parents=True)
    (folder / "COMPLETE.json").write_text("{}")


@pytest.mark.parametrize(
    "damaged, why",
    [
        (b"[1,2]\n", "a JSON list, not a record"),
        (b'"train"\n', "a JSON str, not a record"),
        (b'{"kind": "train"}\n', "a train record whose step is None, not a whole number"),
        (b'{"kind": "train", "step": Infinity}\n', "a train record whose step is inf, not a whole number"),
        (b'{"kind": "train", "step": NaN}\n', "a train record whose step is nan, not a whole number"),
        (b'{"kind": "train", "step": "25x"}\n', "a train record whose step is '25x', not a whole number"),
        (b'{"kind": "train", "step": 2.5e9}\n', "a train record whose step is 2500000000.0, not a whole number"),
        (b'{"kind": "train", "step": -3}\n', "a train record whose step is -3, not a whole number"),
        (b'{"kind": "train", "step": true}\n', "a train record whose step is True, not a whole number"),
        ('{"kind": "train", "step": 99, "note": "é'.encode()[:-1] + b"\n", "not UTF-8 text"),
        (b'{"kind": "train"\n', "not a JSON record (Expecting ',' delimiter)"),
    ],
)
def test_a_damaged_log_line_is_skipped_with_a_warning_naming_the_file_and_line(tmp_path, damaged, why):
    """The line between two good ones and as the last (cut) line: the rest of the log and the checkpoints decide."""
    metrics = tmp_path / "metrics.jsonl"
    good = [json.dumps({"kind": "train", "step": step}).encode() + b"\n" for step in (11, 12)]
    for lines, number in (([good[0], damaged, good[1]], 2), ([*good, damaged.rstrip(b"\n")], 3)):
        metrics.write_bytes(b"".join(lines))
        said: list[str] = []
        assert run_progress.run_progress(tmp_path, said.append) == (12, None)
        assert said == [f"warning: {metrics}: skipped 1 unreadable line(s) (line {number}: {why})"], said


def test_many_damaged_lines_are_one_warning_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("[1]\n" * 5 + '{"kind": "train", "step": 4}\n')
    said: list[str] = []
    assert run_progress.run_progress(tmp_path, said.append) == (4, None)
    assert said == [
        f"warning: {tmp_path / 'metrics.jsonl'}: skipped 5 unreadable line(s) (line 1: a JSON list, not a record; "
        "line 2: a JSON list, not a record; line 3: a JSON list, not a record and 2 more)"
    ]


@pytest.mark.parametrize("logged", [[5, 10], []], ids=["log-behind-the-checkpoint", "no-log"])
def test_the_step_reached_is_the_newest_of_the_log_and_the_checkpoints(tmp_path, logged):
    """A save on the clock between two logged steps, or a run without metrics.jsonl: at step 20, 0 recomputed."""
    if logged:
        (tmp_path / "metrics.jsonl").write_text(
            "".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in logged)
        )
    _checkpoint(tmp_path, 20)
    assert run_progress.run_progress(tmp_path) == (20, 20)
    decision, said = run_decide(situation(healthy("n4")), progress=run_progress.run_progress(tmp_path))
    assert decision == "relaunch 3 n1,n2,n3 -"
    assert said[0].endswith("at step 20; newest checkpoint: checkpoint step 20"), said
    assert said[-1].endswith("resuming from checkpoint step 20, 0 step(s) recomputed"), said


# ---- node states and Slurm's records ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [
        "IDLE",
        "MIXED",
        "ALLOCATED",
        "ALLOCATED+COMPLETING",
        "MIXED+COMPLETING",
        "IDLE+CLOUD",
        "MIXED+RESERVED",
        "allocated",
        "mixed$",
        "allocated+",
        "idle-",
        "MIXED+PLANNED",
    ],
)
def test_the_states_slurm_documents_as_usable_keep_a_node(state):
    assert slurm_view.usable(state)
    decision, said = run_decide(situation({**healthy(), "n2": state}))
    assert decision == "relaunch 4 n1,n2,n3,n4 -" and "on the same nodes" in said[-1], said


@pytest.mark.parametrize(
    "state, named",
    [
        ("INVAL", "State=INVAL"),
        ("IDLE+INVALID_REG", "State=IDLE+INVALID_REG"),
        ("", "no state reported"),
        ("  ", "no state reported"),
        ("UNKNOWN", "State=UNKNOWN"),
        ("MAINT", "State=MAINT"),
        ("PERFCTRS", "State=PERFCTRS"),
        ("IDLE+POWERING_UP", "State=IDLE+POWERING_UP"),
        ("MIXED+REBOOT_REQUESTED", "State=MIXED+REBOOT_REQUESTED"),
        ("ALLOCATED+NOT_RESPONDING", "State=ALLOCATED+NOT_RESPONDING"),
        ("mixed~", "State=mixed~"),
        ("idle@", "State=idle@"),
        ("BLOCKED", "State=BLOCKED"),
        ("IDLE+SOMETHING_NEW", "State=IDLE+SOMETHING_NEW"),
    ],
)
def test_every_other_state_is_unusable_and_named(state, named):
    assert not slurm_view.usable(state)
    decision, said = run_decide(situation({**healthy(), "n2": state}))
    assert decision == "relaunch 3 n1,n3,n4 -", said
    assert said[0].startswith(f"lost n2 ({named}) at step 63"), said


def test_a_node_slurm_no_longer_knows_is_named_so():
    states = {node: "MIXED" for node in ("n1", "n3", "n4")}
    decision, said = run_decide(situation(states, job_nodes=NODES))
    assert decision == "relaunch 3 n1,n3,n4 -" and said[0].startswith("lost n2 (unknown to Slurm)"), said


@pytest.mark.parametrize(
    "line",
    [
        "JobId=7 JobName=x NodeList=n1 BatchHost=n1 Requeue=1 Comment=moved from NodeList=n[1-2] BatchHost=n2",
        "JobId=7 JobName=a NodeList=n[1-2] Requeue=0 UserId=0(0) NodeList=n1 BatchHost=n1 Requeue=1",
        "JobId=7 NodeList=n1 BatchHost=n1 Requeue=1 Reason=Requeue=0 NodeList=n[1-2] AdminComment=BatchHost=n2",
    ],
)
def test_free_text_fields_of_a_record_cannot_pose_as_its_keys(line):
    record = slurm_view.parse_record(line)
    assert (record["NodeList"], record["BatchHost"], record["Requeue"]) == ("n1", "n1", "1"), record
    node = slurm_view.parse_record("NodeName=n2 Arch=x86_64 State=DOWN+NOT_RESPONDING Reason=was State=IDLE [root]")
    assert node["State"] == "DOWN+NOT_RESPONDING"


# ---- python -m txl_dist.supervision.slurm_nodes relaunch, against fake scontrol
# ---------------------------------------


def relaunch(tmp_path, job, nodes, *args, train_args=None, environ=None):
    """`slurm_nodes relaunch` in a process of its own, against the fake scontrol: (status, stdout, stderr)."""
    folder = tmp_path / "slurm"
    env = fake_slurm.install(folder)
    for name in ("TXL_MIN_NODES", "TXL_MAX_RELAUNCHES", "TXL_RANKS_PER_NODE"):
        env.pop(name, None)
    env.update(environ or {})
    (folder / "job").write_text(job + "\n")
    (folder / "nodes").write_text("".join(f"NodeName={node} State={state}\n" for node, state in nodes.items()))
    run = tmp_path / "run"
    command = [sys.executable, "-m", "txl_dist.supervision.slurm_nodes", "relaunch", "--job", "7"]
    if not any(arg.startswith("--step-nodes") for arg in args):
        command += ["--step-nodes", "n[1-2]"]
    for flag, value in (("--ranks-per-node", "1"), ("--relaunches", "0")):
        if flag not in args:
            command += [flag, value]
    command += [*args, "--", *(train_args or ["--config", "configs/tiny_cpu.yaml", f"train.output_dir={run}"])]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr


JOB = "JobId=7 JobName=txl NodeList=n1 BatchHost=n1 Requeue=1"
LOST_N2 = {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING"}


def test_a_damaged_log_does_not_decide_the_relaunch(tmp_path):
    """The campaign's case: a `[1,2]` line in metrics.jsonl was a traceback and no answer (the end of the job)."""
    run = tmp_path / "run"
    _checkpoint(run, 10)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 14}\n[1,2]\n{"kind": "train", "step": 15}\n')
    status, out, err = relaunch(tmp_path, JOB, LOST_N2)
    assert (status, out) == (0, "relaunch 1 n1 -\n"), err
    assert f"warning: {run / 'metrics.jsonl'}: skipped 1 unreadable line(s) (line 2: a JSON list" in err
    assert "at step 15; newest checkpoint: checkpoint step 10" in err and "5 step(s) recomputed" in err, err


def test_a_blank_or_foreign_job_record_is_unknown_and_the_answer_is_the_safe_requeue(tmp_path):
    for job in ("", "   ", "scontrol: something else"):
        status, out, err = relaunch(tmp_path, job, {"n1": "MIXED", "n2": "MIXED"})
        assert (status, out) == (0, "requeue\n"), err
        assert "cannot read Slurm's view of the job" in err and "removed from the job" not in err, err


@pytest.mark.parametrize("requeue, verdict", [("1", "requeue"), ("0", "end")])
def test_a_run_the_planner_cannot_read_gets_the_safe_verdict(tmp_path, requeue, verdict):
    """A config file gone since the step started: the planner fails, and answers what cannot lose the run."""
    job = JOB.replace("Requeue=1", f"Requeue={requeue}")
    status, out, err = relaunch(tmp_path, job, LOST_N2, train_args=["--config", str(tmp_path / "gone.yaml")])
    assert (status, out) == (0, f"{verdict}\n"), err
    assert "cannot plan a relaunch (" in err and "gone.yaml" in err and "Traceback" not in err, err
    # On healthy nodes the same failure of reading is no reason to requeue: the job ends as before.
    job = job.replace("NodeList=n1", "NodeList=n[1-2]")
    status, out, err = relaunch(tmp_path, job, {"n1": "MIXED", "n2": "MIXED"}, train_args=["--config", "gone.yaml"])
    assert (status, out) == (0, "end\n"), err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks-per-node", "0"], "--ranks-per-node '0' is not allowed: a whole number from 1 to 4096"),
        (["--ranks-per-node", "two"], "--ranks-per-node 'two' is not allowed: a whole number from 1 to 4096"),
        (
            ["--ranks-per-node", "99999999999999999999"],
            "--ranks-per-node '99999999999999999999' is not allowed: a whole number from 1 to 4096",
        ),
        (["--relaunches", "-2"], "--relaunches '-2' is not allowed: a whole number of at least 0"),
        (["--relaunches", "1.0"], "--relaunches '1.0' is not allowed: a whole number of at least 0"),
        (["--step-nodes", "n1,n1,n2"], "--step-nodes 'n1,n1,n2' names n1 more than once"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_naming_the_flag(tmp_path, args, message):
    status, out, err = relaunch(tmp_path, JOB, LOST_N2, *args)
    assert (status, out, err) == (2, "", f"slurm.sbatch: error: {message}\n")


@pytest.mark.parametrize("nodes", ["0", "-3", "two", ""])
def test_check_refuses_a_bad_node_count_naming_the_flag(nodes, capsys):
    assert slurm_nodes.main(["check", "--nodes", nodes]) == 2
    err = capsys.readouterr().err
    assert err == f"slurm.sbatch: error: --nodes {nodes!r} is not allowed: a whole number of at least 1\n", err


# ---- launchers/slurm.sbatch, against fake srun, scontrol and scancel --------------------------------------------

_SIGNAL_SCRIPT = 'kill -{signal} "$(cat {folder}/script_pid)"; sleep 0.5\n'


def sbatch(tmp_path, job=JOB, nodes=LOST_N2, srun_status=(1, 0), environ=None, planner=None, hooks=None):
    """`bash launchers/slurm.sbatch` as Slurm starts it for job 7 on n[1-2] (one rank each), the fakes on PATH:
    (status, log, the fakes' folder). PLANNER, when given, is the body of a TXL_PYTHON wrapper that runs in place
    of `python -m txl_dist.supervision.slurm_nodes relaunch ...` (the real one is `"$PY" "$@"`); HOOKS: fake -> bash."""
    folder = tmp_path / "slurm"
    env = fake_slurm.install(folder)
    for name in [name for name in env if name.startswith("TXL_")]:
        del env[name]
    (folder / "job").write_text(job + "\n")
    (folder / "nodes").write_text("".join(f"NodeName={node} State={state}\n" for node, state in nodes.items()))
    (folder / "srun_status").write_text("\n".join(map(str, srun_status)))
    (folder / "hooks").mkdir()
    for name, body in (hooks or {}).items():
        (folder / "hooks" / name).write_text(body.format(folder=folder))
    python = sys.executable
    if planner is not None:
        wrapper = folder / "python"
        wrapper.write_text(
            f'#!/bin/bash\nPY={sys.executable}\nif [ "$3" = relaunch ]; then\n{planner.format(folder=folder)}\nfi\n'
            'exec "$PY" "$@"\n'
        )
        wrapper.chmod(0o755)
        python = str(wrapper)
    env.update(
        SLURM_JOB_ID="7",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS="2",
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_CPUS_ON_NODE="2",
        TXL_PYTHON=python,
    )
    env.update(environ or {})
    run = tmp_path / "run"
    script = subprocess.Popen(
        ["bash", "launchers/slurm.sbatch", "--config", "configs/tiny_cpu.yaml", f"train.output_dir={run}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    (folder / "script_pid").write_text(str(script.pid))
    log, _ = script.communicate(timeout=120)
    return script.returncode, log, folder


def _signal_at(signal: str, when: str) -> dict:
    """The sbatch() arguments that send SIGNAL to the batch script WHEN: while the failing step runs (before the
    planning), while the planner runs, or once the planner has decided and before the script reads its answer."""
    send = _SIGNAL_SCRIPT.replace("{signal}", signal)
    if when == "before":
        return {"hooks": {"srun": f"[ -e {{folder}}/signalled ] || {{{{ touch {{folder}}/signalled; {send}}}}}"}}
    if when == "during":
        return {"planner": send}
    return {"planner": f'answer="$("$PY" "$@")"; status=$?\n{send}printf "%s\\n" "$answer"; exit $status'}


PLANS = {
    "relaunch": {},
    "requeue": {"environ": {"TXL_MAX_RELAUNCHES": "0"}},
    "end": {
        "nodes": {"n1": "MIXED", "n2": "MIXED"},
        "job": JOB.replace("NodeList=n1", "NodeList=n[1-2]"),
        "srun_status": (2, 0),
    },
}
"""The three answers of the planner to the failed first step, and what makes it give each: n2 lost with a relaunch
left, n2 lost with none left (TXL_MAX_RELAUNCHES=0), no node lost and a rank that refused its input (exit 2)."""

# (plan, signal) -> (srun calls, `scontrol requeue` calls, the script's status). Without a signal the plan is
# followed; the time limit (USR1) turns a relaunch into a requeue and keeps a requeue; SIGTERM (scancel, or a
# preemption, which Slurm requeues itself) ends the job without a new step or a requeue.
POLICY = {
    ("relaunch", None): (2, 0, 0),
    ("requeue", None): (1, 1, 1),
    ("end", None): (1, 0, 2),
    ("relaunch", "USR1"): (1, 1, 0),
    ("requeue", "USR1"): (1, 1, 1),
    ("end", "USR1"): (1, 0, 2),
    ("relaunch", "TERM"): (1, 0, 1),
    ("requeue", "TERM"): (1, 0, 1),
    ("end", "TERM"): (1, 0, 2),
}


@pytest.mark.parametrize(
    "plan, signal, when",
    [(plan, None, None) for plan in PLANS]
    + [(plan, signal, when) for plan in PLANS for signal in ("USR1", "TERM") for when in ("before", "during", "after")],
)
def test_every_plan_and_stop_signal_ends_the_job_as_the_policy_says(tmp_path, plan, signal, when):
    """The campaign's case: the plan `requeue` with USR1 during the planning logged "requeueing" twice, never
    called `scontrol requeue` and exited 1."""
    status, log, folder = sbatch(tmp_path, **PLANS[plan], **(_signal_at(signal, when) if signal else {}))
    sruns, requeues = fake_slurm.calls(folder, "srun"), fake_slurm.calls(folder, "scontrol requeue")
    assert (len(sruns), len(requeues), status) == POLICY[plan, signal], log
    if signal:
        assert ("time limit near" if signal == "USR1" else "SIGTERM: asking every rank") in log, log
    if len(sruns) == 2:
        assert "--overlap --mem=0 --nodelist=n1 --nodes=1 --ntasks-per-node=1 --ntasks=1" in sruns[1]
    assert log.count("requeueing job") == len(requeues), log


@pytest.mark.parametrize(
    "answer",
    [
        "exit 1",
        "exit 2",
        "echo; exit 0",
        "echo relaunch x n1; exit 0",
        "echo relaunch 1; exit 0",
        "echo maybe; exit 0",
        "printf 'relaunch 1 n1 -\\nend\\n'; exit 0",
        "echo relaunch 1 n1; exit 0",
        "echo requeue now; exit 0",
        "kill -9 $$",
    ],
)
def test_a_planner_without_a_clear_answer_requeues_a_requeueable_job(tmp_path, answer):
    status, log, folder = sbatch(tmp_path, planner=answer)
    assert len(fake_slurm.calls(folder, "srun")) == 1, log
    assert fake_slurm.calls(folder, "scontrol requeue") == ["scontrol requeue 7"], log
    assert "slurm.sbatch: the relaunch planner gave no answer (exit " in log and "requeueing job 7" in log, log
    assert status != 0


def test_a_requeue_that_slurm_refuses_ends_the_job_naming_slurms_reason(tmp_path):
    """A job submitted with --no-requeue whose planner could not tell: Slurm's refusal, in one line."""
    folder = tmp_path / "slurm"
    folder.mkdir()
    (folder / "requeue_refused").write_text("scontrol: error: Requested operation is presently disabled for job 7\n")
    status, log, folder = sbatch(tmp_path, planner="exit 1")
    assert status == 1 and fake_slurm.calls(folder, "scontrol requeue") == ["scontrol requeue 7"], log
    assert (
        "slurm.sbatch: Slurm did not requeue job 7 (scontrol: error: Requested operation is presently disabled for "
        "job 7): the job ends with status 1"
    ) in log, log


def test_a_damaged_log_line_does_not_end_the_job(tmp_path):
    """The campaign's sb_trace_ends: a `[1,2]` line in metrics.jsonl ended a job that had lost a node."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 3}\n[1,2]\n')
    status, log, folder = sbatch(tmp_path)
    assert status == 0 and len(fake_slurm.calls(folder, "srun")) == 2, log
    assert f"warning: {tmp_path / 'run' / 'metrics.jsonl'}: skipped 1 unreadable line(s) (line 2:" in log, log


@pytest.mark.parametrize(
    "name, value, allowed",
    [
        ("TXL_RANKS_PER_NODE", "0", "a whole number from 1 to 4096"),
        ("TXL_RANKS_PER_NODE", "abc", "a whole number from 1 to 4096"),
        ("TXL_RANKS_PER_NODE", "-1", "a whole number from 1 to 4096"),
        ("TXL_RANKS_PER_NODE", "1.5", "a whole number from 1 to 4096"),
        ("TXL_RANKS_PER_NODE", "99999999999999999999", "a whole number from 1 to 4096"),
        ("TXL_MIN_NODES", "abc", "a whole number of at least 1"),
        ("TXL_MAX_RELAUNCHES", "-1", "a whole number of at least 0"),
        ("TXL_SPARE_NODES", "one", "a whole number of at least 0"),
        ("TXL_SPARE_NODES", "-1", "a whole number of at least 0"),
    ],
)
def test_a_bad_variable_stops_the_job_before_anything_starts(tmp_path, name, value, allowed):
    status, log, folder = sbatch(tmp_path, environ={name: value})
    assert (status, log) == (2, f"slurm.sbatch: error: {name}={value!r} is not allowed: {allowed}\n")
    assert fake_slurm.calls(folder, "srun") == [] and fake_slurm.calls(folder, "scontrol requeue") == []


def test_a_python_that_does_not_run_stops_the_job_naming_txl_python(tmp_path):
    status, log, folder = sbatch(tmp_path, environ={"TXL_PYTHON": "/no/such/python"})
    assert (status, log) == (
        2,
        "slurm.sbatch: error: TXL_PYTHON='/no/such/python' is not allowed: a Python command that runs here "
        "(default python)\n",
    )
    assert fake_slurm.calls(folder, "srun") == []


@pytest.mark.parametrize(
    "python, said",
    [("/bin/false", "nothing, and failed"), ("/usr/bin/python3", "ModuleNotFoundError: No module named")],
    ids=["false", "python-without-the-project"],
)
def test_a_python_that_cannot_import_the_project_stops_the_job_naming_txl_python(tmp_path, python, said):
    """The campaign's neighbours: /bin/false exited 2 without a word; a system Python without the project's
    packages printed a traceback and never named the variable."""
    status, log, folder = sbatch(tmp_path, environ={"TXL_PYTHON": python})
    assert status == 2 and log.count("\n") == 1, log
    assert log.startswith(
        f"slurm.sbatch: error: TXL_PYTHON='{python}' is not allowed: a Python that imports txl_dist (it said: {said}"
    ), log
    assert fake_slurm.calls(folder, "srun") == []


def test_ranks_per_node_from_the_variable_reach_srun(tmp_path):
    status, log, folder = sbatch(tmp_path, srun_status=(0,), environ={"TXL_RANKS_PER_NODE": " 2 "})
    assert status == 0 and "2 rank(s) per node, 1 CPU(s) per rank" in log, log
    assert "--nodes=2 --ntasks-per-node=2 --ntasks=4 --cpus-per-task=1" in fake_slurm.calls(folder, "srun")[0]


def test_a_relaunch_that_slurm_refuses_requeues_the_job_naming_slurms_reason(tmp_path):
    """The relaunched step, refused by Slurm (here its memory, which the failed step still held), ended the job:
    its one node is healthy, so the planner saw no lost node."""
    refusal = "Unable to create step for job 7: Memory required by task is not available"
    hook = f'[ -e {{folder}}/relaunched ] && echo "srun: error: {refusal}" >&2; touch {{folder}}/relaunched\n'
    status, log, folder = sbatch(tmp_path, srun_status=(1, 1), hooks={"srun": hook})
    assert len(fake_slurm.calls(folder, "srun")) == 2, log
    assert fake_slurm.calls(folder, "scontrol requeue") == ["scontrol requeue 7"], log
    assert f"slurm.sbatch: Slurm refused the relaunched step ({refusal}): requeueing the job" in log, log


def test_every_step_takes_the_jobs_memory_without_reserving_a_share(tmp_path):
    status, log, folder = sbatch(tmp_path)
    assert status == 0 and all(" --mem=0 " in call for call in fake_slurm.calls(folder, "srun")), log


# ---- the ranks' fault log, a rank lost on a healthy node, hot spares -----------------------------------------------

HEALTHY_JOB = JOB.replace("NodeList=n1", "NodeList=n[1-2]")
HEALTHY = {"n1": "MIXED", "n2": "MIXED"}


def _record_hook(run: Path, kind: str, rank: int, host: str, step: int, then: str = "") -> dict:
    """A fake srun hook that writes what the ranks of the failing step record (txl_dist.supervision.guard), under the
    step's TXL_LAUNCH, then runs THEN."""
    record = (
        f'{{{{"kind": "{kind}", "rank": {rank}, "host": "{host}", "step": {step}, "world_size": 2, '
        f'"message": "train.py: error: rank {rank} ({host}) {kind} at step {step}", "launch": "\'"$TXL_LAUNCH"\'"}}}}'
    )
    return {"srun": f"mkdir -p {run}; echo '{record}' >> {run}/faults.jsonl\n{then}"}


def test_relaunch_reads_the_ranks_records_and_remembers_its_decision(tmp_path):
    """`slurm_nodes relaunch` against fake Slurm: n2 is ALLOCATED for Slurm, its rank died and no step runs there:
    lost at once. Its decision goes to the fault log, where the next failure finds it."""
    run = tmp_path / "run"
    run.mkdir()
    faults_path = run / "faults.jsonl"
    record = fault("died", 1, "n2", world_size=2, launch="7.0.0", slurm_step="7.0")
    faults_path.write_text(json.dumps(record) + "\n")
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "dead_nodes").write_text("n2\n")
    status, out, err = relaunch(tmp_path, HEALTHY_JOB, HEALTHY, "--launch", "7.0.0", "--status", "137")
    assert (status, out) == (0, "relaunch 1 n1 -\n"), err
    assert "lost n2 (named by the ranks and no step runs there: srun failed (exit 1): srun: error: Task launch" in err
    assert fake_slurm.calls(tmp_path / "slurm", "srun")[0].endswith("--nodelist=n2 --quiet hostname")
    plan = json.loads(faults_path.read_text().splitlines()[-1])
    assert (plan["kind"], plan["launch"], plan["lost"], plan["decision"]) == ("plan", "7.0.0", ["n2"], out.strip())


def test_the_batch_script_relaunches_a_step_that_failed_on_healthy_nodes_on_the_same_nodes(tmp_path):
    status, log, folder = sbatch(
        tmp_path, job=HEALTHY_JOB, nodes=HEALTHY, hooks=_record_hook(tmp_path / "run", "died", 1, "n2", 61)
    )
    steps = [call for call in fake_slurm.calls(folder, "srun") if "launchers/train.py" in call]
    assert status == 0 and len(steps) == 2, log
    assert "--overlap --mem=0 --nodelist=n1,n2 --nodes=2 --ntasks-per-node=1 --ntasks=2" in steps[1], log
    assert "relaunch 1 of 3 (TXL_MAX_RELAUNCHES) on the same nodes: world 2 as before" in log, log
    assert fake_slurm.calls(folder, "scontrol requeue") == [], log


def test_a_failure_repeated_at_the_same_step_ends_the_job_in_one_line_without_a_loop(tmp_path):
    status, log, folder = sbatch(
        tmp_path,
        job=HEALTHY_JOB,
        nodes=HEALTHY,
        srun_status=(1, 1, 1, 1),
        hooks=_record_hook(tmp_path / "run", "error", 0, "n1", 61),
    )
    steps = [call for call in fake_slurm.calls(folder, "srun") if "launchers/train.py" in call]
    assert status == 1 and len(steps) == 2, log
    came_back = [line for line in log.splitlines() if "came back" in line]
    assert came_back == [
        "slurm.sbatch: the failure came back at step 61 after a relaunch (rank 0 (n1) at step 61: train.py: error: "
        "rank 0 (n1) error at step 61): not retrying it again, the job ends; the same command resumes from the "
        "newest checkpoint once the cause is fixed"
    ], log
    assert fake_slurm.calls(folder, "scontrol requeue") == [], log


def test_a_spare_node_replaces_a_lost_one_and_the_world_keeps_its_size(tmp_path):
    """sbatch --nodes 3 with TXL_SPARE_NODES=1: n1 and n2 train, n3 waits; n2 is lost; n3 takes its place."""
    job = "JobId=7 JobName=txl NodeList=n[1,3] BatchHost=n1 Requeue=1"
    nodes = {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING", "n3": "IDLE"}
    environ = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n[1-3]", "TXL_SPARE_NODES": "1"}
    status, log, folder = sbatch(tmp_path, job=job, nodes=nodes, environ=environ)
    steps = [call for call in fake_slurm.calls(folder, "srun") if "launchers/train.py" in call]
    assert status == 0 and len(steps) == 2, log
    assert "--nodelist=n1,n2 --nodes=2 --ntasks-per-node=1 --ntasks=2" in steps[0], log
    assert "--overlap --mem=0 --nodelist=n1,n3 --nodes=2 --ntasks-per-node=1 --ntasks=2" in steps[1], log
    assert "slurm.sbatch: spare n3 takes the place of n2: the world keeps its size" in log, log
    assert "world 2 -> 2 rank(s), the same micro-batches" in log and "(spares: none)" in log, log


def test_the_step_ends_when_the_ranks_name_a_dead_node_without_waiting_for_slurm(tmp_path):
    """The ranks record rank 1 dead; srun goes on waiting for n2, which Slurm still calls ALLOCATED (until its
    SlurmdTimeout). The watcher ends the step after its grace, the planner finds that no step runs on n2, and the
    step goes on n1 alone, long before Slurm would have said anything."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "dead_nodes").write_text("n2\n")
    hook = _record_hook(
        tmp_path / "run",
        "died",
        1,
        "n2",
        61,
        then="[ -e relaunched ] || {{ touch relaunched; exec sleep 60 > /dev/null 2>&1; }}",
    )
    began = time.monotonic()
    # The first srun never answers (the watcher kills it): the status is the relaunched step's.
    status, log, folder = sbatch(tmp_path, job=HEALTHY_JOB, nodes=HEALTHY, srun_status=(0,), hooks=hook)
    took = time.monotonic() - began
    steps = [call for call in fake_slurm.calls(folder, "srun") if "launchers/train.py" in call]
    assert status == 0 and len(steps) == 2 and took < 45, (took, log)
    assert "srun is still waiting for that rank's node 10 s later: ending the step now" in log, log
    assert "--overlap --mem=0 --nodelist=n1 --nodes=1" in steps[1], log
    assert "lost n2 (named by the ranks and no step runs there: " in log, log


def test_the_batch_script_reads_host_lists_with_the_one_parser(capsys):
    """`slurm_nodes check --nodelist`: the job's Slurm host list as names, one a line (each range keeps its own
    width), as the planner reads NodeList; a list that is no host list is refused in one line (status 2)."""
    names = ["gpu01", "gpu02", "gpu03", "gpu7", "login-a1-ib", "login-a2-ib"]
    assert slurm_nodes.main(["check", "--nodes", "6", "--nodelist", "gpu[01-03,7],login-a[1-2]-ib"]) == 0
    assert capsys.readouterr().out.split() == names
    assert slurm_view.hostnames("gpu[01-03,7],login-a[1-2]-ib") == names
    assert slurm_nodes.main(["check", "--nodes", "2", "--nodelist", "gpu[3-1]"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("slurm.sbatch: error: cannot read SLURM_JOB_NODELIST='gpu[3-1]'")


def test_a_time_limit_signal_during_the_check_starts_no_step_and_requeues(tmp_path):
    """The time limit's USR1 while the script's first Python run checks its variables (a --time shorter than the
    signal's lead sends it in the job's first seconds): the check's own status stands, no training step starts,
    and the job is requeued (the cluster holds the next run: tests/cluster/test_launch_paths.py)."""
    signalled = tmp_path / "signalled"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'if [ "$3" = check ] && [ ! -e {signalled} ]; then touch {signalled} && kill -USR1 "$PPID" && sleep 1; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    status, log, folder = sbatch(tmp_path, environ={"TXL_PYTHON": str(wrapper)})
    assert signalled.exists(), log
    assert "is not allowed" not in log and "stop asked before the training step started" in log, log
    assert "no training step ran; requeueing job" in log, log
    assert not fake_slurm.calls(folder, "srun") and len(fake_slurm.calls(folder, "scontrol requeue")) == 1, log


@pytest.mark.parametrize(
    "nodelist, refused",
    [("n[1-2],n[1-2]", "names n1, n2 more than once"), ("n[1-2],(null)", "names '(null)', which is no host name")],
)
def test_the_jobs_host_list_names_each_node_once_and_only_host_names(nodelist, refused, capsys):
    """sb_dup_nodelist, chk_hl_14: the first step once ran on n1,n2,n1,n2, and '(null)' (Slurm's word for an
    empty list) was taken as a node."""
    assert slurm_nodes.main(["check", "--nodes", "2", "--nodelist", nodelist]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"SLURM_JOB_NODELIST={nodelist!r} {refused}" in error[0], error


def test_one_spare_never_takes_two_places(tmp_path):
    """rl_dup_spares: --spares n4,n4 gave `relaunch 3 n1,n4,n4`; it is refused as --step-nodes n1,n1 is."""
    nodes = {"n1": "MIXED", "n2": "DOWN", "n3": "DOWN", "n4": "IDLE"}
    job = "JobId=7 NodeList=n[1-4] BatchHost=n1 Requeue=1 Restarts=0"
    status, out, err = relaunch(tmp_path, job, nodes, "--step-nodes", "n[1-3]", "--spares", "n4,n4")
    assert (status, out) == (2, ""), err
    assert err.strip() == "slurm.sbatch: error: --spares 'n4,n4' names n4 more than once"


def test_a_damaged_plan_record_is_named_not_taken_for_no_failure(tmp_path):
    """sn_plan_failedat_str: a plan record whose failed_at is "12" silently disabled the check for a failure that
    came back at the same step; now a warning names it."""
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"kind": "plan", "launch": "7.0.0", "failed_at": "12", "lost": [], "decision": "relaunch 2 n1,n2 -"},
        {"kind": "error", "launch": "7.0.1", "rank": 1, "host": "n2", "step": 12, "message": "boom", "world_size": 2},
    ]
    (run / "faults.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    job = "JobId=7 NodeList=n[1-2] BatchHost=n1 Requeue=1 Restarts=0"
    status, out, err = relaunch(
        tmp_path, job, {"n1": "MIXED", "n2": "MIXED"}, "--launch", "7.0.1", "--relaunches", "1", "--status", "1"
    )
    assert status == 0, err
    assert "warning: the plan record of step 7.0.0 gives failed_at '12', no step number" in err, err
