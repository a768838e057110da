"""`python -m txl_dist.plot` on runs written by hand (the metrics.jsonl records launchers/train.py writes): a sweep
of many runs stays readable (a look of its own per run, the legend beside no panel, no matplotlib warning), and a
malformed record is left out with one warning naming the file and its line. The plot of real runs, killed and
resumed, is in tests/test_tensorboard.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.launcher import REPO
from txl_dist import plot

HPARAMS = {
    "model.n_layer": 2,
    "model.d_model": 64,
    "model.mem_len": 32,
    "optim.lr": 1e-3,
    "train.global_batch": 8,
    "precision.dtype": "fp32",
    "zero.stage": 2,
    "world_size": 2,
}


def _train(step: int, loss: float) -> dict:
    """A training record as launchers/train.py logs it (the fields the plot reads)."""
    timing = {"wall_time": 1000.0 + step, "tokens": 256 * step, "step_time_s": 1.0}
    return {"step": step, "kind": "train", "loss": loss, "ppl": math.exp(loss), **timing}


def write_run(folder: Path, records: list[dict | str]) -> Path:
    """A run folder whose metrics.jsonl holds ``records`` (a string is written as the line itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [record if isinstance(record, str) else json.dumps(record) for record in records]
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


def _sweep(root: Path, count: int) -> list[plot.Run]:
    runs = []
    for index in range(count):
        start = {"step": 0, "kind": "start", "wall_time": 1000.0, "start": 1, "hparams": {**HPARAMS, "optim.lr": index}}
        train = [_train(step, 6 - step / 10 - index / 100) for step in range(1, 21)]
        evals = [{"step": step, "kind": "eval", "loss": 5.0, "ppl": 148.0} for step in (10, 20)]
        runs.append(plot.read_run(write_run(root / f"lr_{index:02d}", [start, *train, *evals])))
    return runs


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def run_plot(run: Path, out: Path) -> subprocess.CompletedProcess:
    """`python -m txl_dist.plot RUN --out OUT`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "txl_dist.plot", str(run), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("count", [12, 40])
def test_a_sweep_gives_every_run_a_look_of_its_own_and_a_legend_beside_the_panels(count, tmp_path):
    """Runs 0 and 10 once looked the same (one line style, ten colours), and 30 runs put the legend over all six
    panels with only matplotlib's "Tight layout not applied" warning."""
    runs = _sweep(tmp_path, count)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = plot.figure_of(runs, list(plot.AXES))
        figure.canvas.draw()
        picture = plot.draw(runs, list(plot.AXES))
    assert picture[:8] == b"\x89PNG\r\n\x1a\n"
    panels = [axes for axes in figure.axes if axes.get_ylabel() in ("loss (nats/token)", "perplexity")]
    assert len(panels) == 6 and len(figure.axes) == 12  # and the throughput row, each panel with a right axis
    for panel in panels:
        training = [line for line in panel.get_lines() if line.get_linestyle() != "None"]
        looks = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in training}
        assert len(training) == count and len(looks) == count, (count, looks)
        evaluations = [line for line in panel.get_lines() if line.get_linestyle() == "None"]
        assert len({(line.get_color(), line.get_marker()) for line in evaluations}) == count  # 70 before repeating
    [legend] = figure.legends
    entries = legend.legend_handles[:count]
    assert len({(h.get_color(), h.get_linestyle(), h.get_marker()) for h in entries}) == count
    assert [text.get_text() for text in legend.get_texts()][:count] == [run.label() for run in runs]
    renderer = figure.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    figure_box = figure.bbox
    assert figure_box.x0 <= box.x0 and box.x1 <= figure_box.x1 and figure_box.y0 <= box.y0
    for panel in figure.axes:
        assert not _overlaps(box, panel.get_tightbbox(renderer)), (box, panel.get_tightbbox(renderer))


def test_no_two_runs_look_alike_up_to_280_and_neighbours_differ_in_colour_and_marker():
    palette = [f"C{index}" for index in range(10)]
    looks = [tuple(plot.run_style(index, palette).values()) for index in range(plot.DISTINCT_STYLES)]
    assert plot.DISTINCT_STYLES == 280 and len(set(looks)) == 280
    assert all(a[0] != b[0] and a[2] != b[2] for a, b in zip(looks, looks[1:]))


MALFORMED = [
    ({"step": 3, "kind": ["train"], "loss": 5.0}, "'kind' is ['train'], not a string"),
    ({"step": True, "kind": "train", "loss": 5.0}, "'step' is True, not a whole number >= 0"),
    ({"step": -1, "kind": "train", "loss": 5.0}, "'step' is -1, not a whole number >= 0"),
    ({"step": "4", "kind": "train", "loss": 5.0}, "'step' is '4', not a whole number >= 0"),
    ({"step": 4.5, "kind": "train", "loss": 5.0}, "'step' is 4.5, not a whole number >= 0"),
    ({"step": 2**60, "kind": "train", "loss": 5.0}, "not a whole number >= 0 (and below 2^53)"),
    ({"kind": "train", "loss": 5.0}, "'step' is None"),
    ({"step": 4, "kind": "train", "loss": "5.0"}, "'loss' is '5.0', not a number"),
    ({"step": 4, "kind": "eval", "ppl": True}, "'ppl' is True, not a number"),
    ({"step": 4, "kind": "train", "loss": 5.0, "tokens": float("nan")}, "'tokens' is nan, not a finite number >= 0"),
    ({"step": 4, "kind": "train", "loss": 5.0, "wall_time": -3}, "'wall_time' is -3, not a finite number >= 0"),
    ({"step": 4, "kind": "train", "loss": 10**400}, "not a number"),
    ({"step": 0, "kind": "start", "hparams": {"precision.dtype": {"a": 1}}}, "'hparams' is not a mapping of names"),
    ({"step": 0, "kind": "start", "hparams": [1, 2]}, "'hparams' is not a mapping of names"),
    ([1, 2], "a JSON list, not an object"),
    ("{not json", "not a JSON record"),
]


@pytest.mark.parametrize(("bad", "problem"), MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_a_malformed_record_is_left_out_with_one_warning_naming_the_file_and_its_line(bad, problem, tmp_path):
    """Each once drew a wrong point ("step": true as step 1) or ended in a traceback (an unhashable kind, a dict
    in the hparams); the good records around it are drawn, a NaN loss (a diverged step) stays a gap, and a last
    line cut short by a kill is left out without a word."""
    good = [_train(step, 5.0) for step in (1, 2, 3)]
    diverged = {**_train(5, 5.0), "loss": float("nan"), "ppl": float("inf")}
    run = write_run(tmp_path / "run", [good[0], good[1], bad, bad, good[2], diverged])
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as metrics:
        metrics.write('{"step": 6, "kind": "tr')  # torn by a kill
    result = plot.read_run(run)
    assert result.train.steps == [1, 2, 3, 5] and math.isnan(result.train.values["loss"][-1])
    assert [line for line, _ in result.skipped] == [3, 4] and all(problem in p for _, p in result.skipped)
    out = tmp_path / "curves.png"
    completed = run_plot(run, out)
    assert completed.returncode == 0 and out.is_file(), completed.stderr
    assert completed.stderr.splitlines() == [
        f"plot: warning: {run / 'metrics.jsonl'}: 2 malformed record(s) left out of the plot, the first on line 3 "
        f"({result.skipped[0][1]})"
    ]
    assert problem in completed.stderr


def test_a_run_with_only_malformed_records_is_refused_saying_so(tmp_path):
    run = write_run(tmp_path / "run", [{"step": True, "kind": "train", "loss": 5.0}, {"step": 2, "kind": ["train"]}])
    with pytest.raises(plot.PlotError) as refused:
        plot.read_run(run)
    assert str(refused.value) == (
        f"{run / 'metrics.jsonl'}: no training step logged yet (2 malformed record(s) left out, the first on line 1)"
    )


def test_the_label_shows_the_settings_a_start_record_gives(tmp_path):
    start = {"step": 0, "kind": "start", "hparams": {**HPARAMS, "precision.dtype": 16, "optim.lr": True}}
    run = plot.read_run(write_run(tmp_path / "run", [start, _train(1, 5.0)]))
    assert run.label() == f"{tmp_path / 'run'}: 2 layers x d_model 64, mem_len 32, batch 8, 16, ZeRO-2, 2 ranks"


ISSUE_38_RECORDS = [
    {"kind": "train", "step": step, "loss": 5 + step / 10, "ppl": 200.0, "lr": 0.001, "wall_time": 100 + step}
    for step in (1, 2, 3)
]
"""The records of issue 38's report: no tokens (nor step_time_s, tokens_per_s)."""


@pytest.mark.parametrize(
    ("records", "warnings_", "notes"),
    [
        (ISSUE_38_RECORDS, ["the panels against tokens seen are empty: no tokens logged"], {"no tokens logged"}),
        (
            [{key: v for key, v in _train(s, 5.0).items() if key != "wall_time"} for s in (1, 2)],
            [],  # the logged step times make the time axis
            set(),
        ),
        (
            [{key: v for key, v in _train(s, 5.0).items() if key not in ("wall_time", "step_time_s")} for s in (1, 2)],
            ["the panels against training time are empty: no wall_time or step_time_s logged"],
            {"no wall_time or step_time_s logged"},
        ),
        (
            [{key: v for key, v in _train(s, 5.0).items() if key != "loss"} for s in (1, 2)],
            [f"the loss panel against {axis} is empty: no loss logged" for axis in plot.AXES.values()],
            {"no loss logged"},
        ),
        (
            [{key: v for key, v in _train(s, 5.0).items() if key != "ppl"} for s in (1, 2)],
            [f"the ppl panel against {axis} is empty: no ppl logged" for axis in plot.AXES.values()],
            {"no ppl logged"},
        ),
        (
            [{"kind": "train", "step": s} for s in (1, 2)],
            [
                "the loss panel against optimizer step is empty: no loss logged",
                "the ppl panel against optimizer step is empty: no ppl logged",
                "the panels against tokens seen are empty: no tokens logged",
                "the panels against training time are empty: no wall_time or step_time_s logged",
            ],
            {"no loss logged", "no ppl logged", "no tokens logged", "no wall_time or step_time_s logged"},
        ),
    ],
    ids=["no tokens (issue 38)", "no wall_time", "no time at all", "no loss", "no ppl", "step only"],
)
def test_a_field_missing_in_every_record_leaves_its_panels_empty_with_a_note(records, warnings_, notes, tmp_path):
    """A value or an x axis that no record logged (tokens, the time, the loss, the perplexity) once ended in
    matplotlib's IndexError (markevery on a line with no point): the other panels are drawn, each empty panel
    says why in the picture, and the command warns once per empty axis or panel."""
    run = write_run(tmp_path / "run", records)
    out = tmp_path / "curves.png"
    completed = run_plot(run, out)
    assert completed.returncode == 0 and out.is_file(), completed.stderr
    assert completed.stderr.splitlines() == [f"plot: warning: {line}" for line in warnings_]
    figure = plot.figure_of([plot.read_run(run)], list(plot.AXES))
    shown = {text.get_text() for panel in figure.axes for text in panel.texts}
    assert shown - {"no tokens_per_s logged"} == notes


def test_a_run_without_tokens_beside_one_with_them_draws_both_without_a_warning(tmp_path, capsys):
    with_tokens = write_run(tmp_path / "a", [_train(s, 5.0) for s in (1, 2, 3)])
    without = write_run(tmp_path / "b", ISSUE_38_RECORDS)
    out = tmp_path / "curves.png"
    assert plot.main([str(with_tokens), str(without), "--out", str(out), "--x", "tokens"]) == 0
    assert capsys.readouterr().err == "" and out.is_file()


def test_rollbacks_and_skipped_windows_are_marked_on_the_loss_panels(tmp_path):
    """The numerics records of a run (`txl_dist.training.numerics_guard`): a dotted line at each rolled-back step and
    a shaded span over each skipped data window, on the loss and perplexity panels of every x axis, and two legend
    entries; a numerics record whose window is no pair of steps is left out with the file's one warning."""
    fault = {"step": 26, "kind": "numerics", "event": "fault", "loss": "nan", "grad_norm": "inf", "wall_time": 1026.5}
    rollback = {"step": 26, "kind": "numerics", "event": "rollback", "restored_step": 20, "wall_time": 1026.6}
    skip = {"step": 20, "kind": "numerics", "event": "skip", "from_step": 21, "to_step": 26, "wall_time": 1026.7}
    broken = {**skip, "to_step": "26"}
    records = [*(_train(step, 6 - step / 20) for step in range(1, 41)), fault, rollback, skip, broken]
    run = plot.read_run(write_run(tmp_path / "run", records))
    assert run.rollbacks == [26] and run.skipped_windows == [(21, 26)]
    assert run.skipped_warning() == (
        f"{tmp_path / 'run' / 'metrics.jsonl'}: 1 malformed record(s) left out of the plot, the first on line 44 "
        "('to_step' is '26', not a whole number >= 0 (and below 2^53))"
    )
    figure = plot.figure_of([run], list(plot.AXES))
    loss_panel = figure.axes[0]
    lines = [line for line in loss_panel.get_lines() if line.get_linestyle() == ":"]
    assert [line.get_xdata()[0] for line in lines] == [26.0]
    (span,) = loss_panel.patches
    assert span.get_x() == pytest.approx(21.0) and span.get_width() == pytest.approx(5.0)
    tokens_panel = figure.axes[1]
    assert [line.get_xdata()[0] for line in tokens_panel.get_lines() if line.get_linestyle() == ":"] == [26 * 256]
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert labels[-2:] == ["rolled back (numerical fault)", "data window skipped"]


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("mfu", 10**400, "'mfu' is 1000"),
        ("tokens_per_s", 10**400, "'tokens_per_s' is 1000"),
        ("mfu", "high", "'mfu' is 'high', not a number"),
        ("tflops", True, "'tflops' is True, not a number"),
    ],
)
def test_a_throughput_field_that_is_no_number_is_left_out_with_the_warning(field, value, problem, tmp_path):
    """plot_mfu_bigint, plot_tps_bigint: an integer too large for a float was an OverflowError; plot_mfu_str: a
    string was drawn as a gap without the warning docs/watching.md promises."""
    records = [_train(step, 5.0) for step in (1, 2, 3)]
    records[1] = {**records[1], "mfu": 0.1, field: value}
    run = write_run(tmp_path / "run", records)
    completed = run_plot(run, tmp_path / "curves.png")
    assert completed.returncode == 0, completed.stderr
    assert f"1 malformed record(s) left out of the plot, the first on line 2 ({problem}" in completed.stderr
    assert "Traceback" not in completed.stderr


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_metrics_file_that_is_no_regular_file_is_refused_not_read_forever(kind, tmp_path):
    """plot_fifo blocked for good; plot_devzero ran out of memory."""
    run = tmp_path / "run"
    run.mkdir()
    if kind == "fifo":
        os.mkfifo(run / "metrics.jsonl")
    else:
        (run / "metrics.jsonl").symlink_to("/dev/zero")
    completed = run_plot(run, tmp_path / "curves.png")
    assert completed.returncode == 2, completed.stderr
    refused = f"plot: error: {run / 'metrics.jsonl'}: not a regular file (not a metrics.jsonl written by launchers/"
    assert completed.stderr.strip() == refused + "train.py)"
