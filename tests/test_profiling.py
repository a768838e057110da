"""profile.steps: a Chrome trace per rank of the chosen steps with the loop's phases named, the profiled steps
marked in the log, the out-of-memory snapshot hook, and the values refused in one line
(txl_dist/training/profiling.py; docs/profiling.md).

The 2-rank run (torchrun, tests/launcher.py) is the launcher tier's (its two tests are marked); the rest runs in
the quick tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launcher import records, run, torchrun_command
from txl_dist.config import load_config
from txl_dist.training import profiling
from txl_dist.training.profiling import PHASES, OutOfDeviceMemory, out_of_memory_snapshot, trace_path

TRAIN = "launchers/train.py"


def _trace_names(path: Path) -> set[str]:
    trace = json.loads(path.read_text(encoding="utf-8"))
    return {event.get("name", "") for event in trace["traceEvents"]}


@pytest.fixture(scope="module")
def profiled_run(ptb_word_shards, tmp_path_factory) -> dict:
    """Steps 3 to 4 of 6 profiled, with a sampled evaluation and a checkpoint at step 4 inside the window."""
    output = tmp_path_factory.mktemp("profiled") / "run"
    args = [
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.shards={ptb_word_shards}",
        f"train.output_dir={output}",
        "train.max_steps=6",
        "train.micro_batch=2",  # two micro-batches per rank and step: DeepSpeed reduces at the second
        "log.every=1",
        "eval.every=4",
        "eval.max_batches=2",
        "checkpoint.every=4",
        "profile.steps=[3,4]",
        "profile.record_shapes=true",
    ]
    result = run(torchrun_command(TRAIN, args))
    return {"output": output, "log": result.stderr}


@pytest.mark.launcher
def test_each_rank_writes_a_trace_of_the_window_that_names_every_phase(profiled_run):
    output = profiled_run["output"]
    folder = trace_path(output, (3, 4), 0).parent
    assert sorted(path.name for path in folder.iterdir()) == ["rank_0.pt.trace.json", "rank_1.pt.trace.json"]
    for rank in (0, 1):
        names = _trace_names(trace_path(output, (3, 4), rank))
        assert {f"txl_dist/{phase}" for phase in PHASES} <= names, names
        # The window's two steps, and no step outside it.
        steps = sorted(name for name in names if name.startswith("txl_dist/step "))
        assert steps == ["txl_dist/step 3", "txl_dist/step 4"]
        # The gloo all-reduce of the gradients is in the trace, and so are operators with their shapes.
        assert any("allreduce" in name.lower() for name in names)
        assert "aten::mm" in names or "aten::addmm" in names


@pytest.mark.launcher
def test_the_profiled_steps_are_marked_in_the_metrics_and_the_log(profiled_run):
    train = records(profiled_run["output"])
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    assert {step for step, record in train.items() if record.get("profiled")} == {3, 4}
    log = profiled_run["log"]
    assert "profiling steps 3-4 with torch.profiler" in log
    assert "profile of steps 3-4 written" in log
    assert log.count("| profiled") == 2


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["profile.steps=[5,3]"], "profile.steps=[5, 3] is not allowed: null or [A, B]"),
        (["profile.steps=[3]"], "profile.steps=[3] is not allowed: null or [A, B]"),
        (["profile.steps=[2,3,4]"], "profile.steps=[2, 3, 4] is not allowed: null or [A, B]"),
        (["profile.steps=[0,2]"], "profile.steps=[0, 2] is not allowed: a list of integers, or null, each >= 1"),
        (["profile.steps=[true,2]"], "profile.steps=[True, 2] is not allowed: a list of integers"),
        (["profile.steps=3"], "profile.steps=3 is not allowed: a list of integers"),
        (["train.max_steps=10", "profile.steps=[8,11]"], "profile.steps=[8, 11] is not allowed: steps within the run"),
    ],
)
def test_bad_profile_steps_are_refused_in_one_line(overrides, named):
    with pytest.raises(ValueError) as refused:
        load_config("configs/tiny_cpu.yaml", overrides)
    message = str(refused.value)
    assert named in message and "\n" not in message


def test_a_window_that_ends_before_the_start_records_nothing(tmp_path):
    settings = load_config("configs/tiny_cpu.yaml", ["profile.steps=[2,3]"]).profile
    profiler = profiling.StepProfiler(settings, tmp_path, 0, torch.device("cpu"), first_step=4)
    assert profiler.window is None
    resumed_inside = profiling.StepProfiler(settings, tmp_path, 0, torch.device("cpu"), first_step=3)
    assert resumed_inside.window == (3, 3)


def test_without_a_window_a_phase_records_nothing():
    settings = load_config("configs/tiny_cpu.yaml").profile
    profiler = profiling.StepProfiler(settings, Path("."), 0, torch.device("cpu"), first_step=1)
    with torch.profiler.profile() as outside:  # a profiler of someone else's sees no label of ours
        with profiler.phase("forward"), profiler.step_range(1):
            torch.ones(2) + 1
    assert not any(event.name.startswith("txl_dist/") for event in outside.events())


def test_an_out_of_memory_error_on_cuda_writes_the_snapshot_then_one_line(tmp_path):
    written = []

    def dump(path: Path) -> None:  # torch.cuda.memory._dump_snapshot, which needs a GPU (make gpu-check runs it)
        path.write_bytes(b"snapshot")
        written.append(path)

    with pytest.raises(OutOfDeviceMemory) as failure:
        with out_of_memory_snapshot(tmp_path, 1, torch.device("cuda", 0), lambda: 41, dump=dump):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    assert written == [tmp_path / "memory_snapshot_rank_1_step_42.pickle"]
    message = str(failure.value)
    assert "\n" not in message
    assert "rank 1 ran out of device memory in step 42 (CUDA out of memory. Tried to allocate 2.00 GiB)" in message
    assert str(written[0]) in message and "train.micro_batch" in message


def test_a_snapshot_that_cannot_be_written_still_ends_in_one_line(tmp_path):
    def dump(path: Path) -> None:
        raise RuntimeError("record_memory_history was not enabled")

    with pytest.raises(OutOfDeviceMemory, match="no memory snapshot was written"):
        with out_of_memory_snapshot(tmp_path, 0, torch.device("cuda", 0), lambda: 0, dump=dump):
            raise torch.OutOfMemoryError("CUDA out of memory")


def test_on_the_cpu_an_out_of_memory_error_passes_as_it_is(tmp_path):
    with pytest.raises(torch.OutOfMemoryError):
        with out_of_memory_snapshot(tmp_path, 0, torch.device("cpu"), lambda: 0):
            raise torch.OutOfMemoryError("out of memory")
    assert list(tmp_path.iterdir()) == []
