"""The numerics guard's decisions without a process group (`txl_dist.training.numerics`): which step is a fault,
the spike detector on ordinary and spiking curves, the ladder of rollbacks (replay, skip, stop), the data windows
skipped and the run's record of them; and what the checkpoints, snapshots, rotation, the streams, the schedule and
the Slurm planner do with them. The guard in a running world: tests/test_numerics_launcher.py."""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from txl_dist.checkpoint_paths import COMPLETE
from txl_dist.checkpoints import rotation
from txl_dist.checkpoints.snapshot_files import crc32, verified_snapshots, write_snapshot
from txl_dist.checkpoints.verify import health_problem, preflight
from txl_dist.config import NumericsConfig, ScheduleConfig, load_config
from txl_dist.config.fields import ConfigError
from txl_dist.data import TrainStreams
from txl_dist.evaluation import EvalResult, perplexity
from txl_dist.training.numerics import (
    DataSkip,
    Fault,
    NumericsRecord,
    NumericsState,
    Recovery,
    SpikeDetector,
    StepHealth,
    Watch,
    data_key,
    json_number,
)
from txl_dist.training.run_log import _truncate_after
from txl_dist.training.schedule import build_lr_scheduler, learning_rate, set_peak

CONFIG = NumericsConfig()


def watch(config: NumericsConfig = CONFIG, fp16: bool = False, n_token: int = 10_000) -> Watch:
    return Watch(config, NumericsState(config), fp16=fp16, n_token=n_token)


def healthy(loss: float, grad_norm: float | None = 0.5) -> StepHealth:
    return StepHealth(loss=loss, grad_norm=grad_norm)


# ---- the check of one step ------------------------------------------------------------------------------------------


def test_a_loss_or_gradient_norm_that_is_not_finite_is_a_fault_naming_the_rank():
    guard = watch()
    fault = guard.judge(7, StepHealth(loss=math.nan, grad_norm=math.inf, bad_ranks=1, bad_rank_sum=3), False)
    assert fault is not None and (fault.step, fault.check) == (7, "loss")
    assert fault.text == "the loss is nan on rank 3"
    fault = guard.judge(8, StepHealth(loss=math.inf, grad_norm=1.0, bad_ranks=2, bad_rank_sum=3), False)
    assert fault.text == "the loss is inf on 2 ranks"
    fault = guard.judge(9, healthy(5.0, grad_norm=math.nan), False)
    assert (fault.check, fault.text) == ("grad_norm", "the gradient norm is nan")
    assert guard.judge(10, healthy(5.0), False) is None
    assert guard.judge(11, healthy(5.0, grad_norm=None), False) is None  # an engine that reports no norm


def test_a_loss_three_times_worse_than_guessing_is_a_fault_whatever_came_before():
    guard = watch(n_token=10_000)
    bound = 3 * math.log(10_000)
    assert guard.judge(1, healthy(bound - 0.01), False) is None
    fault = guard.judge(2, healthy(bound + 0.01), True)  # even where no spike is judged
    assert fault.check == "max_loss" and "worse than guessing uniformly" in fault.text
    guard = watch(replace(CONFIG, max_loss=12.0))
    assert guard.judge(1, healthy(12.5), False).text == "the loss 12.5000 is above numerics.max_loss=12"


def test_in_fp16_an_overflow_is_the_scalers_work_unless_the_scale_is_pinned_at_its_minimum():
    guard = watch(fp16=True)
    overflow = StepHealth(loss=math.nan, grad_norm=math.inf, bad_ranks=1, overflow=True)
    assert guard.judge(3, overflow, False) is None
    fault = guard.judge(4, overflow._replace(scale_pinned=True), False)
    assert fault.check == "loss_scale" and "pinned at precision.min_loss_scale" in fault.text
    assert watch(fp16=False).judge(3, overflow, False).check == "loss"  # bf16/fp32: a skipped step is a fault


def test_with_the_check_off_nothing_is_a_fault():
    guard = watch(replace(CONFIG, check=False))
    assert guard.judge(1, StepHealth(loss=math.nan, grad_norm=math.inf), False) is None


# ---- spikes ---------------------------------------------------------------------------------------------------------


def ordinary_curve(steps: int, seed: int, noise: float) -> list[float]:
    """A falling training curve with per-step noise: fast at first, then slower (the shape of every run here)."""
    rng = random.Random(seed)
    return [4.0 + 5.0 * math.exp(-step / 150) + rng.gauss(0.0, noise) for step in range(steps)]


@pytest.mark.parametrize("noise", [0.02, 0.1, 0.4])
def test_the_default_detector_never_fires_on_an_ordinary_noisy_curve(noise):
    for seed in range(5):
        guard = watch()
        curve = ordinary_curve(3000, seed, noise)
        faults = [guard.judge(step, healthy(loss), False) for step, loss in enumerate(curve)]
        assert [fault for fault in faults if fault is not None] == []


def test_a_palm_like_spike_is_a_fault_and_stays_out_of_the_window():
    guard = watch()
    curve = ordinary_curve(400, seed=1, noise=0.05)
    for step, loss in enumerate(curve):
        assert guard.judge(step, healthy(loss), False) is None
    before = list(guard.state.detector.history)
    spike = curve[-1] * 1.4  # PaLM's spikes: the loss jumps by tens of percent within a few steps
    fault = guard.judge(400, healthy(spike), False)
    assert fault.check == "spike" and "is a spike" in fault.text and "robust deviations" in fault.text
    assert list(guard.state.detector.history) == before
    assert guard.judge(401, healthy(spike), True) is None  # a step whose memories started empty is not judged
    assert list(guard.state.detector.history) == before  # ... nor kept


def test_the_detector_waits_for_its_window_and_a_flat_window_needs_the_minimum_rise():
    detector = SpikeDetector(window=100, threshold=8.0, min_rise=0.15)
    for _ in range(9):
        detector.add(3.0)
    assert detector.judge(100.0) is None  # nine steps of history: too few to say
    detector.add(3.0)
    assert detector.judge(3.3) is None  # no spread at all, but only 10% above: an ordinary wobble
    assert "the window has no spread" in detector.judge(3.5)
    assert SpikeDetector(window=0, threshold=8.0, min_rise=0.15).judge(1e6) is None  # spike detection off


def test_the_window_travels_with_the_state():
    state = NumericsState(CONFIG)
    for loss in (5.0, 4.0, 3.0):
        state.detector.add(loss)
    state.lr_factor = 0.25
    again = NumericsState(CONFIG)
    again.load_state_dict(json.loads(json.dumps(state.state_dict())), "a checkpoint")
    assert list(again.detector.history) == [5.0, 4.0, 3.0] and again.lr_factor == 0.25
    again.load_state_dict(None, "a checkpoint written before txl_dist kept it")
    assert list(again.detector.history) == [] and again.lr_factor == 1.0


# ---- rollbacks ------------------------------------------------------------------------------------------------------


def fault_at(step: int) -> Fault:
    return Fault(step, "loss", "the loss is nan", math.nan, None)


def test_the_ladder_replays_then_skips_then_stops():
    recovery = Recovery(CONFIG)
    first = recovery.plan(fault_at(26), restored=20)
    assert (first.action, first.attempt, recovery.rollbacks) == ("replay", 1, 1)
    assert recovery.passed(25) is None
    second = recovery.plan(fault_at(26), restored=20)  # the same step failed again
    assert (second.action, second.attempt, recovery.rollbacks) == ("skip", 2, 2)
    third = recovery.plan(fault_at(26), restored=20)
    assert third.action == "stop" and "after a replay and 1 skip(s) from step 20" in third.why
    assert "numerics.max_rollbacks_per_window=2" in third.why and recovery.rollbacks == 2


def test_a_fault_that_passes_on_the_replay_closes_at_its_step():
    recovery = Recovery(CONFIG)
    recovery.plan(fault_at(26), restored=20)
    assert recovery.passed(25) is None
    incident = recovery.passed(26)
    assert (incident.restored, incident.failed, incident.action) == (20, 26, "replay")
    assert recovery.passed(27) is None
    # Another fault from another healthy state starts its own ladder.
    assert recovery.plan(fault_at(34), restored=30).action == "replay"


def test_the_rollbacks_in_all_are_bounded():
    recovery = Recovery(replace(CONFIG, max_rollbacks=3))
    assert [recovery.plan(fault_at(step), restored=step - 1).action for step in (11, 21, 31)] == ["replay"] * 3
    stop = recovery.plan(fault_at(41), restored=40)
    assert stop.action == "stop" and stop.why == "numerics.max_rollbacks=3 rollbacks made"
    assert Recovery(replace(CONFIG, max_rollbacks=0)).plan(fault_at(5), restored=0).action == "stop"


# ---- skipped windows and the run's record ---------------------------------------------------------------------------


def test_skipping_steps_moves_the_streams_exactly_as_taking_them_would_across_an_epoch(ptb_word_shards):
    def streams() -> TrainStreams:
        return TrainStreams(ptb_word_shards, "valid", tgt_len=512, micro_batch=2, grad_accum=2, world_size=2, rank=1)

    taken, skipped = streams(), streams()
    steps = taken.steps_per_epoch + 3  # into the next epoch
    batches = iter(taken)
    for _ in range(steps * taken.grad_accum):
        next(batches)
    assert skipped.skip(steps) == steps * 512 * skipped.num_streams
    assert skipped.state_dict() == taken.state_dict() and skipped.epoch == 1
    after_taken, after_skipped = next(batches), next(iter(skipped))
    assert torch.equal(after_taken.inputs, after_skipped.inputs) and after_taken.step == after_skipped.step
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        skipped.skip(0)


def skip_at(step: int, failed: int, position: int = 0) -> DataSkip:
    data = {"epoch": 0, "step": step, "position": position, "num_streams": 8, "layout": "0123456789abcdef"}
    return DataSkip(at_step=step, failed_step=failed, steps=failed - step, tokens=64 * (failed - step), data=data)


def test_a_skip_is_due_where_the_streams_stand_and_known_once():
    stream_state = {"epoch": 0, "step": 20, "position": 160, "num_streams": 8, "layout_spans": [[0, 929589]]}
    skip = replace(skip_at(20, 26, 160), data=data_key(stream_state))
    state = NumericsState(CONFIG)
    state.add_skips([skip, skip])
    state.add_skips([replace(skip, tokens=999)])  # the same window, as another copy records it
    assert state.skips == [skip] and state.due(stream_state) == skip
    assert state.due({**stream_state, "epoch": 1}) is None  # the same position in the next epoch
    assert state.due({**stream_state, "num_streams": 16}) is None  # streams cut otherwise
    assert state.due({**stream_state, "layout_spans": [[0, 100], [200, 929589]]}) is None


def test_the_record_round_trips_and_refuses_what_it_cannot_read(tmp_path):
    path = tmp_path / "numerics.json"
    assert NumericsRecord.read(path) == NumericsRecord(path)
    record = NumericsRecord(path, [skip_at(20, 26)], ["step00000020"])
    record.write()
    assert NumericsRecord.read(path) == record
    cases = {
        "[]": "expected a JSON object",
        '{"format": "txl_dist.numerics", "version": 2}': "not a numerics record of version 1",
        '{"format": "txl_dist.numerics", "version": 1, "skips": {}}': "'skips' and 'kept_checkpoints' must be lists",
        '{"format": "txl_dist.numerics", "version": 1, "skips": [{"at_step": 1}]}': "a skipped window has other",
        '{"format": "txl_dist.numerics", "version": 1, "skips": [7]}': "a skipped window must be a mapping",
    }
    bad_steps = {**skip_at(20, 26).to_json(), "steps": -1}
    cases[json.dumps({"format": "txl_dist.numerics", "version": 1, "skips": [bad_steps]})] = "'steps' is -1"
    bad_factor = {**skip_at(20, 26).to_json(), "lr_factor": 2}
    cases[json.dumps({"format": "txl_dist.numerics", "version": 1, "skips": [bad_factor]})] = "not a factor in"
    for text, problem in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=problem) as refused:
            NumericsRecord.read(path)
        assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_the_peak_follows_the_run_whatever_the_checkpoints_scheduler_held():
    schedule = ScheduleConfig(kind="cosine", warmup_steps=4)
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([parameter], lr=1e-3)
    scheduler = build_lr_scheduler(optimizer, schedule, max_steps=40)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()  # as a checkpoint holds it, peak 1e-3
    resumed = build_lr_scheduler(torch.optim.AdamW([parameter], lr=5e-4), schedule, max_steps=40)
    resumed.load_state_dict(saved)
    assert set_peak(resumed, 5e-4) == pytest.approx(1e-3)
    expected = learning_rate(10, 5e-4, schedule, 40)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(expected)  # the next update's rate
    resumed.optimizer.step()
    resumed.step()
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(learning_rate(11, 5e-4, schedule, 40))


# ---- what checkpoints record, and who reads it ----------------------------------------------------------------------


def test_a_checkpoint_records_its_steps_health_and_a_sick_one_is_named():
    assert StepHealth(loss=math.nan, grad_norm=math.inf).record() == {"loss": "nan", "grad_norm": "inf"}
    assert StepHealth(loss=3.5, grad_norm=None).record() == {"loss": 3.5, "grad_norm": None}
    assert json_number(-math.inf) == "-inf"
    assert health_problem({"health": {"loss": 3.5, "grad_norm": 0.2}}) is None
    assert health_problem({}) is None  # written before checkpoints recorded it
    assert health_problem({"health": {"loss": "nan", "grad_norm": "inf"}}) == "its step's loss was nan"
    assert health_problem({"health": {"loss": 3.5, "grad_norm": "inf"}}) == "its step's gradient norm was inf"
    assert "no mapping" in health_problem({"health": [1]})


def write_checkpoint(directory: Path, step: int, loss: float | str, architecture: dict | None = None) -> str:
    tag = f"step{step:08d}"
    (directory / tag).mkdir(parents=True)
    marker = {"step": step, "architecture": architecture or {"n_layer": 2}, "health": {"loss": loss}}
    (directory / tag / COMPLETE).write_text(json.dumps(marker))
    return tag


def test_rotation_never_lets_a_sick_checkpoint_push_a_healthy_one_out(tmp_path):
    """numerics.check=false, keep_last=2, and the loss NaN from step 26 on: the checkpoints of steps 30-60 are sick.
    The healthy 10 and 20 stay; the sick ones are rotated among themselves; a kept one is never removed."""
    healthy_tags = [write_checkpoint(tmp_path, step, 3.0) for step in (10, 20)]
    sick_tags = [write_checkpoint(tmp_path, step, "nan") for step in (30, 40, 50, 60)]
    rotation.prune(tmp_path, keep_last=2, keep={sick_tags[-1]}, damaged=set(), sick=set(sick_tags))
    assert sorted(path.name for path in tmp_path.iterdir()) == healthy_tags + sick_tags[2:]
    more = [write_checkpoint(tmp_path, step, 2.5) for step in (70, 80)]
    rotation.prune(tmp_path, keep_last=2, keep={more[-1], healthy_tags[0]}, damaged=set(), sick=set(sick_tags))
    assert sorted(path.name for path in tmp_path.iterdir()) == [healthy_tags[0], *sick_tags[2:], *more]


def test_the_start_checks_the_checkpoint_the_resume_takes_not_a_newer_sick_one(tmp_path):
    write_checkpoint(tmp_path, 10, 3.0, architecture={"n_layer": 2})
    write_checkpoint(tmp_path, 20, "nan", architecture={"n_layer": 4})
    preflight(tmp_path, resume=True, architecture={"n_layer": 2})
    with pytest.raises(ValueError, match="step00000010 was trained with another architecture"):
        preflight(tmp_path, resume=True, architecture={"n_layer": 4})


def test_a_snapshot_of_a_sick_state_is_never_restored(tmp_path, caplog):
    files = {"txl_rank_states/rank00000.pt": b"state"}
    for step, loss in ((12, 3.0), (15, "nan")):
        manifest = {
            "run_id": "a" * 32,
            "output_dir": "/runs/tiny",
            "rank": 0,
            "step": step,
            "world_size": 1,
            "host": "node1",
            "streams_per_rank": 8,
            "architecture": {"n_layer": 2},
            "zero_stage": 2,
            "health": {"loss": loss, "grad_norm": 0.5},
            "files": {name: {"bytes": len(data), "crc32": crc32(data)} for name, data in files.items()},
        }
        write_snapshot(tmp_path / "rank00000" / f"step{step:08d}", manifest, files)
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        found = verified_snapshots(tmp_path, "a" * 32, "/runs/tiny")
    assert list(found) == [(0, 12)]
    assert "step00000015 skipped: its state is sick: its step's loss was nan" in caplog.text


def test_a_resume_keeps_the_records_of_numerical_faults_after_the_step_it_resumes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 20, "kind": "train"},
        {"step": 26, "kind": "numerics", "event": "fault"},
        {"step": 26, "kind": "train"},
        {"step": 30, "kind": "start"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _truncate_after(path, 20)
    assert [json.loads(line) for line in path.read_text().splitlines()] == lines[:2]


def test_a_diverged_models_perplexity_is_inf_not_an_error():
    assert perplexity(2.0) == pytest.approx(math.exp(2.0))
    assert perplexity(1e4) == math.inf and math.isnan(perplexity(math.nan))
    assert EvalResult(targets=10, nll_sum=1e6).ppl == math.inf


def test_the_numerics_section_refuses_what_it_cannot_use():
    cfg = load_config("configs/tiny_cpu.yaml", ["numerics.spike_window=0", "numerics.max_rollbacks=0"])
    assert (cfg.numerics.spike_window, cfg.numerics.max_rollbacks, cfg.numerics.check) == (0, 0, True)
    for override, allowed in (
        ("numerics.lr_factor_after_skip=0", "a factor in (0, 1]"),
        ("numerics.lr_factor_after_skip=1.5", "a factor in (0, 1]"),
        ("numerics.max_rollbacks_per_window=0", "numerics.max_rollbacks_per_window=0 is not allowed"),
        ("numerics.spike_threshold=-1", "numerics.spike_threshold=-1.0 is not allowed"),
        ("numerics.max_loss=0", "numerics.max_loss=0.0 is not allowed"),
    ):
        with pytest.raises(ConfigError, match=allowed.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            load_config("configs/tiny_cpu.yaml", [override])


def test_a_new_peak_keeps_the_schedules_floor():
    """The peak a checkpoint's scheduler held is replaced, not scaled: the floor schedule.min_lr stays the floor."""
    schedule = ScheduleConfig(kind="cosine", warmup_steps=0, min_lr=0.1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, schedule, max_steps=10)
    set_peak(scheduler, 0.5)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert "lr_lambdas" in scheduler.state_dict() and scheduler.state_dict()["lr_lambdas"] == [None]


def test_a_step_whose_update_the_engine_skipped_records_no_sick_state():
    """fp16's loss scaler (or ZeRO's check) skipped the update: the weights are as they were, so a checkpoint of
    that step is healthy, not one a resume passes over."""
    record = StepHealth(loss=math.nan, grad_norm=math.inf, overflow=True).record()
    assert record == {"loss": None, "grad_norm": None, "skipped_update": True}
    assert health_problem({"health": record}) is None
