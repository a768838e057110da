"""When the training loop logs, evaluates, saves and stops (`txl_dist.training.cadence`), without a process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from txl_dist.config import load_config
from txl_dist.training.cadence import Cadence


def _cadence(**overrides) -> Cadence:
    settings = {"max_steps": 10, "max_epochs": None, "log_every": 4, "eval_every": 3, "checkpoint_every": 5}
    return Cadence(**{**settings, **overrides})


def test_the_cadence_is_read_from_the_run_config():
    cfg = load_config(
        [Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"],
        ["train.max_steps=7", "train.max_epochs=2", "log.every=2", "eval.every=0", "checkpoint.every=3"],
    )
    assert Cadence.of(cfg) == Cadence(max_steps=7, max_epochs=2, log_every=2, eval_every=0, checkpoint_every=3)


def test_the_run_stops_at_max_steps_first_then_at_max_epochs():
    cadence = _cadence(max_epochs=2)
    assert cadence.stop_before(9, epoch=1) is None
    assert cadence.stop_before(9, epoch=2) == "max_epochs=2"
    assert cadence.stop_before(10, epoch=2) == "max_steps=10"
    assert _cadence().stop_before(9, epoch=50) is None


def test_logs_every_log_every_steps_and_at_the_last():
    assert [step for step in range(1, 11) if _cadence().log_after(step)] == [4, 8, 10]


def test_sampled_evaluations_skip_the_last_step_which_gets_the_full_pass():
    assert [step for step in range(1, 11) if _cadence().evaluate_after(step)] == [3, 6, 9]
    assert [step for step in range(1, 13) if _cadence(max_steps=12).evaluate_after(step)] == [3, 6, 9]
    assert not any(_cadence(eval_every=0).evaluate_after(step) for step in range(1, 11))


def test_saves_periodically_at_a_new_best_and_on_a_stop_request():
    cadence = _cadence()
    assert [step for step in range(1, 11) if cadence.save_after(step, stopping=False, new_best=False)] == [5]
    assert cadence.save_after(3, stopping=False, new_best=True)
    assert cadence.save_after(7, stopping=True, new_best=False)
    assert cadence.save_after(10, stopping=True, new_best=False)
    # The last step is saved after the final full evaluation, not here.
    assert not _cadence(checkpoint_every=2).save_after(10, stopping=False, new_best=False)
    assert not any(_cadence(checkpoint_every=0).save_after(s, stopping=False, new_best=False) for s in range(1, 11))


def test_the_clock_cadence_saves_once_every_minutes_have_passed_since_the_last_save():
    """The clock is injected: ``clock_save_due(now, last_save)`` on seconds of one monotonic clock."""
    cadence = _cadence(checkpoint_every=0, checkpoint_every_seconds=90.0)
    assert not cadence.clock_save_due(now=1089.9, last_save=1000.0)
    assert cadence.clock_save_due(now=1090.0, last_save=1000.0)
    # A run that saves when due, its steps 40 s apart: saved at steps 3, 6, 9 (a save restarts the clock).
    saved, last_save = [], 0.0
    for step in range(1, 11):
        now = 40.0 * step
        if cadence.save_after(step, stopping=False, new_best=False, clock_due=cadence.clock_save_due(now, last_save)):
            saved.append(step)
            last_save = now
    assert saved == [3, 6, 9]
    # Off at 0 (checkpoint.every_minutes 0 or null); the last step is saved after the final evaluation instead.
    assert not _cadence(checkpoint_every_seconds=0.0).clock_save_due(now=1e9, last_save=0.0)
    assert not cadence.save_after(10, stopping=False, new_best=False, clock_due=True)
    # Steps and minutes together: whichever comes first.
    both = _cadence(checkpoint_every=5, checkpoint_every_seconds=90.0)
    assert both.save_after(5, stopping=False, new_best=False, clock_due=False)
    assert both.save_after(2, stopping=False, new_best=False, clock_due=True)


def test_checkpoint_every_minutes_is_read_and_validated():
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    assert Cadence.of(load_config([tiny], ["checkpoint.every_minutes=2.5"])).checkpoint_every_seconds == 150.0
    assert Cadence.of(load_config([tiny], ["checkpoint.every_minutes=0"])).checkpoint_every_seconds == 0.0
    assert Cadence.of(load_config([tiny], [])).checkpoint_every_seconds == 0.0
    for bad in ("-1", "soon", "true", "nan"):
        with pytest.raises(ValueError, match=r"checkpoint.every_minutes"):
            load_config([tiny], [f"checkpoint.every_minutes={bad}"])
