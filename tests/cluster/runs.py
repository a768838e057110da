"""What the cluster tests of the launch paths share: the run they train, submitting it, reading what it wrote.

Runs of configs/tiny_cpu.yaml, one rank per node, with the learning-rate schedule fixed at `SCHEDULE_STEPS` steps
whatever train.max_steps says, so that a short run is the start of the reference run step for step.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.launcher import REPO, records

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
        expected_loss = (
            expected[step]["loss"] if tolerance == 0 else pytest.approx(expected[step]["loss"], rel=tolerance)
        )
        assert got[step]["loss"] == expected_loss, (output, step, got[step]["loss"], expected[step]["loss"])


# The time limit's signal when a test names none: 10 s before the end. The script's own lead (300 s) would reach a
# job of --time=5 within its first 30 s, a test of the time limit that the test did not ask for.
TIME_LIMIT_SIGNAL = "--signal=B:USR1@10"


def sbatch_job(
    cluster,
    directory: Path,
    steps: int,
    *options: str,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    memory: tuple[str, ...] = ("--mem=1500",),
    nodes: int = 2,
) -> int:
    """The run of STEPS steps submitted as `sbatch OPTIONS launchers/slurm.sbatch ...`; MEMORY is the job's memory
    request (none: the cluster's DefMemPerCPU); NODES the job's node count (3: name the spare partition)."""
    signal = () if any(option.startswith("--signal") for option in options) else (TIME_LIMIT_SIGNAL,)
    return cluster.sbatch(
        [
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            *memory,
            f"--output={directory}/slurm-%j.out",
            *signal,
            *options,
            "launchers/slurm.sbatch",
            *train_args(directory.parent / "shards", directory / "run", steps, *extra),
        ],
        env={**CPU, **(env or {})},
        cwd=REPO,
    )


def assert_identical_run(output: Path, reference_run: Path, steps: int) -> None:
    """Every step 1..STEPS logged with the reference's data checksum and exactly its loss: the same world size
    sums the same gradients in the same order."""
    assert_same_run(output, reference_run, steps, tolerance=0.0)


def train_step_calls(out: str) -> int:
    """How many training steps the batch script started (its start line, then one line per relaunch)."""
    return 1 + out.count("relaunching on")


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


def fresh(shared: Path, name: str) -> Path:
    directory = shared / f"{name}-{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    return directory


def running_at_step(cluster, job: int, directory: Path, step: int) -> None:
    assert cluster.wait_job(job, "RUNNING", timeout=120) == "RUNNING"
    wait_for_logged_step(directory / "run", step)


def newest_checkpoint(run: Path) -> int:
    return max(
        int(path.name.removeprefix("step"))
        for path in (run / "checkpoints").glob("step*")
        if (path / "COMPLETE.json").is_file()
    )
