"""Training and evaluation curves of one or several runs as a picture, without TensorBoard.

    python -m txl_dist.plot runs/lr_3e-4 runs/lr_1e-3 --out curves.png            # against steps, tokens, time
    python -m txl_dist.plot demo/run --x tokens --out demo/curves.png

Reads each run's ``metrics.jsonl`` (what launchers/train.py writes): the loss (top row) and the perplexity, or the
bits per character when every run is a byte or character model (second row), training as lines and evaluations as
dots, and the throughput (bottom row: tokens/s, with the MFU or, where a run's peak is unknown, the model TFLOPS per
rank on the right axis), against optimizer steps, tokens seen and training time (``--x`` picks one). Training time
counts the time of each start of a run (from its "start" record to its last record) and leaves out the time between
an interruption and its resume. The legend names each run and its settings. Needs matplotlib (``pip install
'txl_dist[plot]'``); errors are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from txl_dist.exit_status import USAGE_ERROR, os_error_status, run_command
from txl_dist.fileio import atomic_write, describe_os_error
from txl_dist.run_layout import METRICS

AXES = {"step": "optimizer step", "tokens": "tokens seen", "time": "training time"}
THROUGHPUT = ("tokens_per_s", "mfu", "tflops")
"""The training records' throughput figures that the bottom row draws."""


class PlotError(ValueError):
    """A run or an argument that cannot be drawn (one line)."""


@dataclass
class Curve:
    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Run:
    """One run's curves: ``train`` and ``eval`` hold loss/ppl/bpc by step; ``x`` maps a step to each axis."""

    name: str
    train: Curve
    eval: Curve
    x: dict[str, dict[int, float]]
    hparams: dict
    character_level: bool

    def label(self) -> str:
        h = self.hparams
        if not h:
            return self.name
        settings = [
            f"{h.get('model.n_layer')} layers x d_model {h.get('model.d_model')}",
            f"mem_len {h.get('model.mem_len')}",
            f"lr {h.get('optim.lr'):.3g}" if isinstance(h.get("optim.lr"), (int, float)) else None,
            f"batch {h.get('train.global_batch')}",
            h.get("precision.dtype"),
            f"ZeRO-{h.get('zero.stage')}",
            f"{h.get('world_size')} ranks",
        ]
        return f"{self.name}: " + ", ".join(s for s in settings if s)


def _records(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file (not a run directory of launchers/train.py?)") from None
    except UnicodeDecodeError:
        raise PlotError(f"{path}: not UTF-8 text (not a metrics.jsonl written by launchers/train.py)") from None
    except OSError as error:
        raise PlotError(describe_os_error(error, path)) from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if isinstance(record, dict) and isinstance(record.get("step"), int) and "kind" in record:
            records.append(record)
    return records


def _number(value) -> float:
    """A logged value as a float; NaN (a gap in the curve) for one that is missing or not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _training_time(records: list[dict], train: dict[int, dict]) -> dict[int, float]:
    """Seconds of training up to each step: the time within each start, without the gaps between starts."""
    if not all(math.isfinite(_number(r.get("wall_time"))) for r in records):  # older runs: the logged step times
        elapsed, previous, seconds = {}, 0, 0.0
        for step in sorted(train):
            step_time = _number(train[step].get("step_time_s"))
            seconds += (step_time if math.isfinite(step_time) else 0.0) * (step - previous)
            elapsed[step], previous = seconds, step
        return elapsed
    elapsed, origin, offset, last = {}, None, 0.0, 0.0
    for record in records:
        if record["kind"] == "start" or origin is None:
            origin, offset = record["wall_time"], last
        last = offset + record["wall_time"] - origin
        if record["kind"] != "start":
            elapsed.setdefault(record["step"], last)  # a step's training record comes before its evaluation
    return elapsed


def read_run(directory: str | Path) -> Run:
    """A run's curves from its metrics.jsonl (the last record of a kind at a step wins, so a run resumed over
    steps it had logged before reads as one value per step); PlotError when there is nothing to draw."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "a file, not a run directory" if directory.exists() else "no such run directory"
        raise PlotError(f"{directory}: {what}")
    records = _records(directory / METRICS)
    by_kind: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    hparams: dict = {}
    for record in records:
        if record["kind"] in by_kind:
            by_kind[record["kind"]][record["step"]] = record
        elif record["kind"] == "start" and isinstance(record.get("hparams"), dict):
            hparams = record["hparams"]
    train, evals = by_kind["train"], by_kind["eval"]
    if not train:
        raise PlotError(f"{directory / METRICS}: no training step logged yet")
    character_level = all("bpc" in r for r in train.values())
    last = train[max(train)]
    tokens_per_step = _number(last.get("tokens")) / max(last["step"], 1)
    steps = sorted(set(train) | set(evals))
    elapsed = _training_time(records, train)
    x = {
        "step": {s: float(s) for s in steps},
        "tokens": {s: s * tokens_per_step for s in steps},
        "time": {s: elapsed.get(s, math.nan) for s in steps},
    }

    def curve(chosen: dict[int, dict]) -> Curve:
        result = Curve(sorted(chosen))
        for name in ("loss", "ppl", "bpc", *THROUGHPUT):
            result.values[name] = [_number(chosen[s].get(name)) for s in result.steps]
        return result

    return Run(str(directory), curve(train), curve(evals), x, hparams, character_level)


def _matplotlib():
    """(pyplot, Line2D) of matplotlib drawing to files only (the Agg backend: no display on a login node); an
    ImportError where the extra is not installed."""
    import matplotlib  # optional dependency: pip install 'txl_dist[plot]'

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (it imports matplotlib.lines too)

    return plt, matplotlib.lines.Line2D


def draw(runs: Sequence[Run], axes: Sequence[str]) -> bytes:
    """The picture as PNG bytes: rows loss and ppl/bpc, one column per x axis."""
    plt, Line2D = _matplotlib()
    second = "bpc" if all(run.character_level for run in runs) else "ppl"
    longest = max((t for run in runs for t in run.x["time"].values() if math.isfinite(t)), default=0.0)
    unit, per_unit = next((u for u in (("hours", 3600.0), ("minutes", 60.0)) if longest >= 2 * u[1]), ("seconds", 1.0))
    figure, grid = plt.subplots(3, len(axes), figsize=(5.2 * len(axes), 10.4), squeeze=False, sharex="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(runs):
        color = colors[index % len(colors)]
        for column, axis in enumerate(axes):
            for row, metric in enumerate(("loss", second)):
                plot = grid[row][column]
                for curve, style in ((run.train, {"linewidth": 1.2}), (run.eval, {"marker": "o", "linestyle": "--"})):
                    xs = [run.x[axis][s] / (per_unit if axis == "time" else 1) for s in curve.steps]
                    plot.plot(xs, curve.values[metric], color=color, **style)
    for column, axis in enumerate(axes):
        throughput_panel(
            grid[2][column], runs, [run.x[axis] for run in runs], per_unit if axis == "time" else 1, colors
        )
        grid[2][column].set_xlabel(f"{AXES[axis]} ({unit})" if axis == "time" else AXES[axis])
        for row, metric in enumerate(("loss", second)):
            grid[row][column].set_ylabel({"loss": "loss (nats/token)", "ppl": "perplexity", "bpc": "bits/char"}[metric])
            grid[row][column].grid(True, alpha=0.3)
        if second == "ppl":
            grid[1][column].set_yscale("log")
    handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=3) for i in range(len(runs))]
    handles += [Line2D([], [], color="gray"), Line2D([], [], color="gray", marker="o", linestyle="--")]
    labels = [run.label() for run in runs] + ["training", "evaluation"]
    figure.legend(handles, labels, loc="lower center", ncol=1, fontsize=9, frameon=False)
    figure.tight_layout(rect=(0, 0.04 * (len(runs) + 2), 1, 1))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def throughput_panel(plot, runs: Sequence[Run], xs: Sequence[dict[int, float]], per_unit: float, colors) -> None:
    """Training tokens/s of each run (solid, left axis) and its MFU in percent (dotted, right axis); the model
    TFLOPS per rank instead of the MFU when a run has none (no known peak: a CPU without train.peak_tflops).
    Runs logged before these figures existed draw tokens/s only."""
    use_mfu = all(any(math.isfinite(v) for v in run.train.values["mfu"]) for run in runs)
    right = plot.twinx()
    for index, (run, x) in enumerate(zip(runs, xs)):
        color = colors[index % len(colors)]
        steps = run.train.steps
        at = [x[s] / per_unit for s in steps]
        plot.plot(at, run.train.values["tokens_per_s"], color=color, linewidth=1.2)
        second = [100 * v for v in run.train.values["mfu"]] if use_mfu else run.train.values["tflops"]
        right.plot(at, second, color=color, linewidth=1.2, linestyle=":")
    plot.set_ylabel("tokens/s (solid)")
    right.set_ylabel("MFU % (dotted)" if use_mfu else "model TFLOPS per rank (dotted)")
    plot.grid(True, alpha=0.3)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m txl_dist.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (train.output_dir)")
    parser.add_argument("--out", required=True, help="the PNG file to write")
    parser.add_argument("--x", choices=[*AXES, "all"], default="all", help="the x axis (default: all three)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _matplotlib()  # the optional extra: say how to get it before reading anything
    except ImportError:
        print("plot: error: matplotlib is not installed: pip install 'txl_dist[plot]'", file=sys.stderr)
        return USAGE_ERROR  # as for a flag of a feature this installation lacks: the fix is the user's
    out = Path(args.out)
    try:
        if out.is_dir():
            raise PlotError(f"--out {out}: a directory, not a file")
        if out.suffix.lower() != ".png":
            raise PlotError(f"--out {out}: the picture is a PNG, name it *.png")
        if not out.parent.is_dir():
            raise PlotError(f"--out {out}: no such directory {out.parent}")
        runs = [read_run(run) for run in args.runs]
        picture = draw(runs, list(AXES) if args.x == "all" else [args.x])
        atomic_write(out, lambda handle: handle.write(picture))
    except PlotError as error:
        print(f"plot: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as error:  # a read-only or full output (1), a folder in the way (2)
        print(f"plot: error: --out {describe_os_error(error, out)}", file=sys.stderr)
        return os_error_status(error)
    steps = ", ".join(f"{run.name} ({max(run.train.steps)} steps)" for run in runs)
    print(f"plot: {out} ({len(picture):,} bytes): {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "plot"))
