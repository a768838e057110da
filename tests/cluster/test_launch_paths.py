"""Every way users start a job, run for real on the two-node test cluster (tests/cluster/harness.py): each trains
with the per-step losses of a 2-rank torchrun reference of the same run, and Slurm's time limit, scancel,
preemption and a lost node end as the README says.

Runs of configs/tiny_cpu.yaml, one rank per node, with the learning-rate schedule fixed at `SCHEDULE_STEPS` steps
whatever train.max_steps says, so that a short run is the start of the reference run step for step.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.launcher import REPO, TORCHRUN, environment, free_port, records, run

pytestmark = pytest.mark.usefixtures("slurm_cluster")

PYTHON = sys.executable
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))
SCHEDULE_STEPS = 1000
REFERENCE_STEPS = 700
CPU = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TXL_PYTHON": PYTHON}


def train_args(shards: Path, output: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.shards={shards}",
        f"train.output_dir={output}",
        f"train.max_steps={steps}",
        f"schedule.total_steps={SCHEDULE_STEPS}",
        "log.every=1",
        "eval.every=0",
        "eval.batch_size=64",
        "eval.tgt_len=32",
        "checkpoint.every=50",
        "checkpoint.keep_last=0",
        *extra,
    ]


@pytest.fixture(scope="module")
def shared(slurm_cluster, ptb_word_shards) -> Path:
    """A folder on the filesystem the nodes share, with the PTB shards in it."""
    directory = slurm_cluster.shared_dir / f"launch-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    shutil.copytree(ptb_word_shards, directory / "shards")
    return directory


@pytest.fixture(scope="module")
def reference_run(shared) -> Path:
    """The uninterrupted run on one host: 2 ranks under torchrun (its output directory)."""
    output = shared / "reference"
    run(
        [
            TORCHRUN,
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "launchers/train.py",
            *train_args(shared / "shards", output, REFERENCE_STEPS),
        ],
        timeout=400,
    )
    return output


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, float]:
    """Per-step losses of the uninterrupted run."""
    return losses(reference_run)


def losses(output: Path) -> dict[int, float]:
    return {step: record["loss"] for step, record in records(output).items()}


def assert_same_losses(output: Path, reference: dict[int, float], steps: int) -> None:
    got = losses(output)
    assert sorted(got) == list(range(1, steps + 1)), f"{output}: logged steps {sorted(got)[:5]}...{sorted(got)[-5:]}"
    different = [step for step in got if got[step] != reference[step]]
    assert not different, (
        f"{output}: steps {different[:10]} differ from the reference ({got[different[0]]} vs {reference[different[0]]})"
    )


def assert_same_run(output: Path, reference_run: Path, steps: int, tolerance: float = 1e-5) -> None:
    """Every step 1..STEPS logged, with the reference's data checksum and its loss within TOLERANCE (relative): a
    world of another size sums the same gradients in another order. A step logged twice (recomputed after a
    restart) counts by its last record."""
    got, expected = records(output), records(reference_run)
    assert sorted(got) == list(range(1, steps + 1)), f"{output}: logged steps {sorted(got)[:5]}...{sorted(got)[-5:]}"
    for step in range(1, steps + 1):
        assert got[step]["data_checksum"] == expected[step]["data_checksum"], (output, step)
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=tolerance), (output, step)


def sbatch_job(
    cluster, directory: Path, steps: int, *options: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> int:
    return cluster.sbatch(
        [
            "--nodes=2",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--mem=1500",
            f"--output={directory}/slurm-%j.out",
            *options,
            "launchers/slurm.sbatch",
            *train_args(directory.parent / "shards", directory / "run", steps, *extra),
        ],
        env={**CPU, **(env or {})},
        cwd=REPO,
    )


def job_output(directory: Path) -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted(directory.glob("slurm-*.out")))


def wait_for_logged_step(output: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logged = records(output)
        if logged and max(logged) >= step:
            return
        time.sleep(0.2)
    pytest.fail(f"{output}: no step {step} within {timeout} s")


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


def fresh(shared: Path, name: str) -> Path:
    directory = shared / f"{name}-{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    return directory


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
    """.deepspeed_env written as the README says, from the variables set where deepspeed is typed."""
    path = directory / ".deepspeed_env"
    result = subprocess.run(
        [PYTHON, "-m", "txl_dist.launch_env", "--write-deepspeed-env", "--path", str(path)],
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


def _running_at_step(cluster, job: int, directory: Path, step: int) -> None:
    assert cluster.wait_job(job, "RUNNING", timeout=120) == "RUNNING"
    wait_for_logged_step(directory / "run", step)


def test_scancel_checkpoints_and_does_not_requeue(slurm_cluster, shared, reference):
    directory = fresh(shared, "scancel")
    job = sbatch_job(slurm_cluster, directory, REFERENCE_STEPS, "--time=5", "--signal=B:USR1@10")
    _running_at_step(slurm_cluster, job, directory, 5)
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
    _running_at_step(slurm_cluster, job, directory, 5)
    slurm_cluster.scontrol("requeue", str(job))
    assert slurm_cluster.wait_job(job, "COMPLETED", timeout=180) == "COMPLETED", job_output(directory)[-3000:]
    out = job_output(directory)
    stopped = re.findall(r"done: (\d+) steps \(\d+ this run\) in [0-9.]+ s, [0-9]+ tokens/s, stopped by SIGTERM", out)
    assert stopped and 5 <= int(stopped[0]) < 60, out[-3000:]
    assert re.search(rf"resumed from \S+ at step {stopped[0]} \(exact", out), out[-3000:]
    assert "restart 1" in out
    assert_same_losses(directory / "run", reference, 60)


def _newest_checkpoint(run: Path) -> int:
    return max(
        int(path.name.removeprefix("step"))
        for path in (run / "checkpoints").glob("step*")
        if (path / "COMPLETE.json").is_file()
    )


def _print_cost_of_the_loss(directory: Path, lost_at: int, timeout: float = 240) -> None:
    """Prints how long the job took, from the node's loss, to relaunch and to be back at step LOST_AT (detection,
    restart and recomputation: the figure the README quotes)."""
    began = time.monotonic()
    relaunched = None
    while time.monotonic() - began < timeout:
        if relaunched is None and "relaunching on" in job_output(directory):
            relaunched = round(time.monotonic() - began)
        metrics = directory / "run" / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().count(f'{{"step": {lost_at}, "kind": "train"') >= 2:
            back = time.monotonic() - began
            print(f"lost at step {lost_at}: relaunched after {relaunched} s, back at that step after {back:.0f} s")
            return
        time.sleep(0.5)


def test_a_lost_node_costs_a_relaunch_on_the_node_left_within_the_same_job(slurm_cluster, shared, reference_run):
    """The second node dies (every process of it) at step 60: the ranks name it, Slurm marks it DOWN, and the
    batch script starts the step again on the first node alone, inside the same allocation (--no-kill). The one
    rank resumes from the step-50 checkpoint with 4 accumulation steps instead of 2 and finishes the run: the same
    data in the same order (checksums equal) and the same losses within float tolerance, without a requeue."""
    directory = fresh(shared, "elastic")
    steps = 100
    job = sbatch_job(slurm_cluster, directory, steps, "--time=5", "--signal=B:USR1@10")
    _running_at_step(slurm_cluster, job, directory, 60)  # past the checkpoint of step 50
    lost = slurm_cluster.nodes[1]
    slurm_cluster.kill_node(lost)
    try:
        _print_cost_of_the_loss(directory, max(records(directory / "run")))
        wait_for_logged_step(directory / "run", steps, timeout=240)
        state = slurm_cluster.wait_job(job, timeout=60)
    finally:
        slurm_cluster.restart_node(lost)
        slurm_cluster.resume_node(lost)
    out = job_output(directory)
    assert state == "COMPLETED", (state, out[-3000:])
    lost_at = re.search(
        rf"slurm.sbatch: lost {lost} \(.*DOWN.*\) at step (\d+); newest checkpoint: checkpoint step 50", out
    )
    assert lost_at and int(lost_at.group(1)) >= 60, out[-3000:]
    recomputed = int(lost_at.group(1)) - 50
    assert re.search(
        r"relaunch 1 of 3 .* on txlnode1: world 2 -> 1 rank\(s\).*"
        rf"resuming from checkpoint step 50, {recomputed} step\(s\) recomputed",
        out,
    ), out[-3000:]
    assert re.search(r"resumed from \S+step00000050 at step 50 \(exact", out), out[-3000:]
    assert "restart 1" not in out and "requeue" not in out, out[-3000:]
    # One run of the job: Slurm's record of the node's removal (RESIZING), then its end; a requeue would add one.
    assert [record["JobState"] for record in slurm_cluster.job_history(job)] == ["RESIZING", "COMPLETED"]
    assert_same_run(directory / "run", reference_run, steps)


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
    _running_at_step(slurm_cluster, job, directory, 60)  # past the checkpoint of step 50
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
    newest = _newest_checkpoint(directory / "run")
    again = sbatch_job(slurm_cluster, directory, newest + 10, "--time=5", "--signal=B:USR1@10")
    assert slurm_cluster.wait_job(again, timeout=180) == "COMPLETED", job_output(directory)[-3000:]
    assert re.search(rf"resumed from \S+ at step {newest} \(exact", job_output(directory)), job_output(directory)[
        -3000:
    ]
    got = losses(directory / "run")
    assert all(got[step] == reference[step] for step in range(newest + 1, newest + 11))


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


def _elastic_torchrun(cluster, node: str, directory: Path, port: int) -> subprocess.Popen:
    """`torchrun --nnodes 1:2 --rdzv-backend c10d` on NODE, as the README shows it, its output in a file of
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
            env=CPU,
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
    reference's data and losses."""
    directory = fresh(shared, "torchrun-grow")
    port = free_port()
    first = _elastic_torchrun(slurm_cluster, slurm_cluster.nodes[0], directory, port)
    second = None
    try:
        wait_for_logged_step(directory / "run", 20)
        second = _elastic_torchrun(slurm_cluster, slurm_cluster.nodes[1], directory, port)
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
