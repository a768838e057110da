"""The numerics guard in a running world (docs/recovery.md, Numerical faults): 2 CPU ranks through torchrun or the
real `deepspeed` launcher, faults injected from outside the product by tests/scripts/numerics_faults (a
``sitecustomize`` on the ranks' PYTHONPATH: `tests.numerics_faults`), over ZeRO stages 0, 2 and 3 in fp32 and
bf16, rolling back to a checkpoint and to a memory snapshot. The decisions themselves: tests/test_numerics.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launcher import (
    STEPS,
    TRAIN,
    copy_at_step,
    records,
    run,
    tail,
    torchrun_command,
)
from tests.launcher import tiny_args as args
from tests.numerics_faults import batch_digest, fault_environment
from txl_dist.checkpoints.verify import read_marker, verify_checkpoint

pytestmark = pytest.mark.launcher


def every_record(output: Path) -> list[dict]:
    """metrics.jsonl in order, every record (a replayed step appears twice)."""
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def events(output: Path) -> list[tuple[str, int]]:
    """The numerics records: (event, step), in order."""
    return [(r["event"], r["step"]) for r in every_record(output) if r["kind"] == "numerics"]


def event(output: Path, name: str) -> dict:
    (record,) = [r for r in every_record(output) if r["kind"] == "numerics" and r["event"] == name]
    return record


def checkpoint_losses(output: Path) -> dict[str, object]:
    """The loss each complete checkpoint recorded (COMPLETE.json ``health``), by tag."""
    markers = sorted((output / "checkpoints").glob("step*/COMPLETE.json"))
    return {path.parent.name: read_marker(path.parent)["health"]["loss"] for path in markers}


def assert_every_checkpoint_healthy(output: Path) -> None:
    losses = checkpoint_losses(output)
    assert losses and all(isinstance(loss, float) and math.isfinite(loss) for loss in losses.values()), losses


def assert_same_run(got: Path, expected: Path, steps) -> None:
    """The last record of each step: the same loss and data, bit for bit."""
    mine, theirs = records(got), records(expected)
    for step in steps:
        assert mine[step]["loss"] == theirs[step]["loss"], step
        assert mine[step]["data_checksum"] == theirs[step]["data_checksum"], step


def test_a_transient_nan_on_one_rank_is_replayed_to_exactly_the_uninterrupted_run(reference, ptb_word_shards, tmp_path):
    """ZeRO-2 fp32: rank 1's loss is NaN at one forward of step 23 (and never again). The ranks roll back to the
    checkpoint of step 20, replay, pass step 23, and the run is the uninterrupted one, step for step."""
    output = tmp_path / "transient"
    result = run(
        torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={STEPS}")),
        env=fault_environment(nan_at_call="1:45"),  # 2 forwards per step: step 23, slot 0
    )
    assert_same_run(output, reference, range(1, STEPS + 1))
    assert events(output) == [("fault", 23), ("rollback", 23), ("transient", 23)]
    fault, rollback = event(output, "fault"), event(output, "rollback")
    assert (fault["check"], fault["reason"], fault["loss"]) == ("loss", "the loss is nan on rank 1", "nan")
    assert (rollback["restored_step"], rollback["plan"], rollback["source"]) == (20, "replay", "checkpoint")
    verdicts = [line for line in result.stderr.splitlines() if "the fault was transient" in line]
    assert len(verdicts) == 1 and "step 23 passed on the replay from step 20" in verdicts[0], tail(result)
    assert_every_checkpoint_healthy(output)
    record = json.loads((output / "numerics.json").read_text())
    assert record["skips"] == [] and record["kept_checkpoints"] == ["step00000020"]
    # TensorBoard: the replay's values stand (one per step), and the fault and rollback are scalars of their own.
    events_file = EventAccumulator(str(output / "tensorboard"))
    events_file.Reload()
    assert [point.step for point in events_file.Scalars("train/loss")] == list(range(1, STEPS + 1))
    for tag in ("numerics/fault", "numerics/rollback", "numerics/transient"):
        assert [point.step for point in events_file.Scalars(tag)] == [23], tag


def test_a_spike_rolls_back_to_the_memory_snapshot_under_zero_3_bf16(ptb_word_shards, tmp_path):
    """ZeRO-3 bf16, a memory snapshot every 3 steps beside checkpoints every 10: rank 0's loss is 4 times what it
    is at one forward of step 20, finite, a spike the detector names. The ranks go back to the snapshot of step 18
    (newer than the checkpoint of step 10), written back as a checkpoint; the replay of step 19 gives exactly the
    record of its first pass, and step 20 passes."""
    output, memory = tmp_path / "spike", tmp_path / "memory"
    overrides = (
        "zero.stage=3",
        "zero.stage3_param_persistence_threshold=0",
        "precision.dtype=bf16",
        "checkpoint.memory_every=3",
        f"checkpoint.memory_dir={memory}",
        "train.max_steps=24",
    )
    result = run(
        torchrun_command(TRAIN, args(ptb_word_shards, output, *overrides)),
        env=fault_environment(spike_at_call="0:39", spike_factor=4),
    )
    assert events(output) == [("fault", 20), ("rollback", 20), ("transient", 20)], tail(result)
    fault, rollback = event(output, "fault"), event(output, "rollback")
    assert fault["check"] == "spike" and "is a spike" in fault["reason"], fault
    assert (rollback["restored_step"], rollback["source"]) == (18, "memory snapshot")
    assert "restored step 18 from the memory snapshots of 2 rank(s)" in result.stderr
    passes = [r for r in every_record(output) if r["kind"] == "train" and r["step"] == 19]
    assert len(passes) == 2 and passes[0]["loss"] == passes[1]["loss"], passes
    assert passes[0]["data_checksum"] == passes[1]["data_checksum"]
    assert_every_checkpoint_healthy(output)
    assert not memory.exists() or list(memory.rglob("*")) == []  # a clean end frees the snapshots


def test_a_poisoned_window_is_skipped_exactly_and_a_resume_skips_it_again(ptb_word_shards, tmp_path):
    """ZeRO-0 bf16: one batch of rank 0 (step 26's, known by its tokens) gives a NaN loss whenever it is met. The
    replay meets it again, so the ranks go back to step 20 once more and skip the data of steps 21-26, recorded in
    numerics.json once step 26 passes. The run as a kill at step 28 leaves it (its checkpoint of step 20, its
    record; the later checkpoints and metrics gone) resumes from step 20 and skips the same window from the record
    without meeting the batch: its data and losses are those of the uninterrupted run, step for step."""
    poison = batch_digest(ptb_word_shards, [], world_size=2, rank=0, step=26)
    overrides = ("zero.stage=0", "precision.dtype=bf16", f"train.max_steps={STEPS}")
    whole = tmp_path / "poisoned"
    command = torchrun_command(TRAIN, args(ptb_word_shards, whole, *overrides))
    result = run(command, env=fault_environment(poison=poison))
    assert events(whole) == [
        ("fault", 26),
        ("rollback", 26),
        ("fault", 26),
        ("skip", 20),
        ("rollback", 26),
        ("skip_recorded", 26),
    ], tail(result)
    skip = event(whole, "skip")
    assert (skip["from_step"], skip["to_step"], skip["steps"], skip["tokens"]) == (21, 26, 6, 6 * 8 * 8)
    assert "skipped the data of steps 21-26 (6 steps, 384 tokens)" in result.stderr
    assert math.isfinite(records(whole, "eval")[STEPS]["loss"])
    (recorded,) = json.loads((whole / "numerics.json").read_text())["skips"]
    assert (recorded["at_step"], recorded["failed_step"], recorded["data"]["position"]) == (20, 26, 20 * 8)
    assert_every_checkpoint_healthy(whole)

    killed = copy_at_step(whole, 20, tmp_path / "killed")  # what a kill at step 28 leaves, numerics.json with it
    command = torchrun_command(TRAIN, args(ptb_word_shards, killed, *overrides))
    resumed = run(command, env=fault_environment(poison=poison))
    assert "resumed from" in resumed.stderr and "at step 20 (exact" in resumed.stderr
    assert "step 20: skipping the data window recorded after the fault at step 26" in resumed.stderr
    assert "numerical fault" not in resumed.stderr
    assert_same_run(killed, whole, range(1, STEPS + 1))


def test_a_run_that_cannot_be_cured_stops_with_status_4_keeping_its_healthy_checkpoint(
    reference, ptb_word_shards, tmp_path
):
    """Resumed at step 20 with a learning rate far too high: the loss leaves any sense at step 22; a replay and a
    skip do not cure it, so every rank stops with one line and status 4 (what the launcher's agent reports of each
    rank; the deepspeed launcher passes it on as its own: tests/test_train_launcher.py). The checkpoint of step 20
    is still there and verifies, nothing newer is complete, the fault log says why for the Slurm planner; the same
    command with the learning rate put back resumes from it into the uninterrupted run."""
    output = copy_at_step(reference, 20, tmp_path / "diverged")
    command = torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={STEPS}", "optim.lr=1e4"))
    result = run(command, check=False)
    text = tail(result, 400)
    codes = re.findall(r"exitcode\s*:\s*(\d+)", text)  # the agent names each rank that failed, and its status
    assert result.returncode != 0 and set(codes) == {"4"} and len(codes) >= 2, text
    errors = [line for line in text.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1 and "numerical fault at step 22: the loss" in errors[0], text
    assert "came back after a replay and 1 skip(s) from step 20" in errors[0]
    assert f"the newest healthy checkpoint {output / 'checkpoints' / 'step00000020'} is kept" in errors[0]
    assert not [line for line in text.splitlines() if line.strip().startswith('File "') and "txl_dist/" in line]
    complete = sorted(path.parent.name for path in (output / "checkpoints").glob("step*/COMPLETE.json"))
    assert complete == ["step00000010", "step00000020"]
    assert verify_checkpoint(output / "checkpoints" / "step00000020") == []
    fault = json.loads((output / "faults.jsonl").read_text().splitlines()[-1])
    assert (fault["kind"], fault["step"]) == ("numerics", 22)
    record = json.loads((output / "numerics.json").read_text())
    assert record["skips"] == [] and record["kept_checkpoints"] == ["step00000020"]  # a skip that cured nothing

    run(torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={STEPS}")))
    assert_same_run(output, reference, range(21, STEPS + 1))


def test_with_the_check_off_a_sick_checkpoint_is_never_resumed_nor_pushes_a_healthy_one_out(ptb_word_shards, tmp_path):
    """numerics.check=false, ZeRO-0 fp32 (whose optimizer applies a NaN update): one NaN loss at step 23 leaves
    the weights NaN, and the run trains on as asked, to its end, with no traceback. Its checkpoints of steps 30
    and 40 record that loss; with checkpoint.keep_last=2 the healthy ones of steps 10 and 20 stay. The same command
    with the check on passes over the sick ones and resumes from step 20."""
    output = tmp_path / "unchecked"
    overrides = ("zero.stage=0", "checkpoint.keep_last=2")
    command = torchrun_command(TRAIN, args(ptb_word_shards, output, *overrides, f"train.max_steps={STEPS}"))
    result = run(command + ["numerics.check=false"], env=fault_environment(nan_at_call="1:45"))
    assert "Traceback" not in result.stderr and "valid ppl nan" in result.stderr
    assert all(math.isnan(records(output)[step]["loss"]) for step in range(23, STEPS + 1))
    assert checkpoint_losses(output).keys() == {"step00000010", "step00000020", "step00000030", "step00000040"}
    assert checkpoint_losses(output)["step00000040"] == "nan"

    resumed = run(torchrun_command(TRAIN, args(ptb_word_shards, output, *overrides, "train.max_steps=32")))
    for tag in ("step00000040", "step00000030"):
        assert f"skipping checkpoint {output / 'checkpoints' / tag}, whose recorded state is sick" in resumed.stderr
    assert "at step 20 (exact" in resumed.stderr
    assert all(math.isfinite(records(output)[step]["loss"]) for step in range(21, 33))
    losses = checkpoint_losses(output)
    assert [tag for tag, loss in losses.items() if loss == "nan"] == ["step00000040"]  # step 30 saved anew
    assert {"step00000030", "step00000032"} <= losses.keys()
