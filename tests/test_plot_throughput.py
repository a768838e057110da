"""The throughput row of `python -m txl_dist.plot` (tokens/s with the MFU, or the TFLOPS per rank where the MFU is
unknown), drawn from hand-written metrics.jsonl files of the trainer's format; the real run's picture is in
tests/test_tensorboard.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from txl_dist import plot
from txl_dist.run_paths import METRICS

STEPS = (10, 20, 30)


def _run(directory: Path, tokens_per_s: list[float], tflops: list[float], mfu: list[float | None]) -> Path:
    """A run folder whose metrics.jsonl holds a start and three training records, as launchers/train.py writes
    them (mfu null where the run knew no peak)."""
    directory.mkdir()
    lines = [{"step": 0, "kind": "start", "wall_time": 1000.0, "start": 1, "hparams": {"precision.dtype": "bf16"}}]
    for index, step in enumerate(STEPS):
        lines.append(
            {
                "step": step,
                "kind": "train",
                "wall_time": 1000.0 + step,
                "loss": 5.0 - index,
                "ppl": math.exp(5.0 - index),
                "tokens": step * 256,
                "tokens_per_s": tokens_per_s[index],
                "flops_per_token": 1.5e6,
                "tflops": tflops[index],
                "mfu": mfu[index],
            }
        )
    (directory / METRICS).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    return {
        "gpu": _run(tmp_path / "gpu", [9000.0, 9500.0, 9400.0], [120.0, 126.0, 125.0], [0.121, 0.127, 0.126]),
        "cpu": _run(tmp_path / "cpu", [1200.0, 1300.0, 1250.0], [0.01, 0.011, 0.0105], [None, None, None]),
    }


def _panel(runs: list[plot.Run]):
    plt, _ = plot._matplotlib()
    figure, axes = plt.subplots()
    plot.throughput_panel(
        axes, runs, [run.x["step"] for run in runs], 1, [plot.run_style(i, ["C0", "C1"]) for i in range(2)]
    )
    left, right = figure.axes
    drawn = (
        [list(line.get_ydata()) for line in left.get_lines()],
        [list(line.get_ydata()) for line in right.get_lines()],
        right.get_ylabel(),
    )
    plt.close(figure)
    return drawn


def test_the_throughput_panel_draws_tokens_per_s_and_mfu_in_percent(runs):
    run = plot.read_run(runs["gpu"])
    tokens, second, label = _panel([run])
    assert tokens == [[9000.0, 9500.0, 9400.0]]
    assert second == [pytest.approx([12.1, 12.7, 12.6])] and label.startswith("MFU %")


def test_the_throughput_panel_draws_tflops_per_rank_where_a_run_knows_no_peak(runs):
    gpu, cpu = plot.read_run(runs["gpu"]), plot.read_run(runs["cpu"])
    assert all(math.isnan(value) for value in cpu.train.values["mfu"])  # null in the file
    tokens, second, label = _panel([gpu, cpu])
    assert tokens == [[9000.0, 9500.0, 9400.0], [1200.0, 1300.0, 1250.0]]
    assert second == [[120.0, 126.0, 125.0], [0.01, 0.011, 0.0105]] and label == "model TFLOPS per rank (dotted)"


def test_the_picture_has_the_throughput_row_below_loss_and_perplexity(runs, tmp_path):
    out = tmp_path / "curves.png"
    assert plot.main([str(runs["gpu"]), str(runs["cpu"]), "--x", "step", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    figure = plot.figure_of([plot.read_run(runs["gpu"]), plot.read_run(runs["cpu"])], ["step"])
    figure.canvas.draw()
    rows = {axes.get_ylabel(): axes.get_position().y0 for axes in figure.axes}
    # Three rows of one column, the throughput (and its right axis) at the bottom.
    assert rows["loss (nats/token)"] > rows["perplexity"] > rows["tokens/s (solid)"]
    assert rows["model TFLOPS per rank (dotted)"] == rows["tokens/s (solid)"]  # the CPU run knows no peak
