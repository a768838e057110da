"""Training and evaluation curves of one or several runs as a picture, without TensorBoard.

    python -m txl_dist.plot runs/lr_3e-4 runs/lr_1e-3 --out curves.png            # against steps, tokens, time
    python -m txl_dist.plot demo/run --x tokens --out demo/curves.png

Reads each run's ``metrics.jsonl`` (what launchers/train.py writes): the loss (top row) and the perplexity, or the
bits per character when every run is a byte or character model (second row), training as lines and evaluations as
dots, and the throughput (bottom row: tokens/s, with the MFU or, where a run's peak is unknown, the model TFLOPS per
rank on the right axis), against optimizer steps, tokens seen and training time (``--x`` picks one). Training time
counts the time of each start of a run (from its "start" record to its last record) and leaves out the time between
an interruption and its resume. Each run has a colour, line style and marker of its own (up to 280 runs, a sweep),
and the legend below the panels names each run and its settings. A run's numerical faults
(`txl_dist.training.numerics`) are marked on its loss and perplexity panels: a dotted line in its colour at each step
that was rolled back, a shaded span over each data window it skipped. A malformed record (a step that is not a whole
number >= 0, a value that is not a number, ...) is left out with one warning per file naming its first line; a
panel with nothing to draw (a value or an x axis that no record logged: tokens, the time, the loss) stays empty
with a note saying what is missing, and a warning names it.
Needs matplotlib (``pip install 'txl_dist[plot]'``); errors are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from txl_dist.exit_status import USAGE_ERROR, os_error_status, run_command
from txl_dist.fileio import atomic_write, describe_os_error
from txl_dist.run_paths import METRICS

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
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """The malformed records of metrics.jsonl that were left out: (line number, what is wrong)."""
    rollbacks: list[int] = field(default_factory=list)
    """The steps that failed the numerics check and were rolled back."""
    skipped_windows: list[tuple[int, int]] = field(default_factory=list)
    """The data windows skipped after a fault: (first step, last step) whose data was passed over."""

    def x_at(self, axis: str, step: int) -> float:
        """Where ``step`` lies on ``axis``: the place of the first logged step at or after it (NaN: none)."""
        logged = self.x[axis]
        following = [s for s in logged if s >= step]
        return logged[min(following)] if following else math.nan

    def label(self) -> str:
        h = self.hparams
        if not h:
            return self.name
        lr = h.get("optim.lr")
        settings = [
            f"{h.get('model.n_layer')} layers x d_model {h.get('model.d_model')}",
            f"mem_len {h.get('model.mem_len')}",
            f"lr {lr:.3g}" if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None,
            f"batch {h.get('train.global_batch')}",
            None if h.get("precision.dtype") is None else str(h["precision.dtype"]),
            f"ZeRO-{h.get('zero.stage')}",
            f"{h.get('world_size')} ranks",
        ]
        return f"{self.name}: " + ", ".join(s for s in settings if s)

    def skipped_warning(self) -> str | None:
        """One line for the records left out, naming the file, their count and the first one; None for none."""
        if not self.skipped:
            return None
        line, problem = self.skipped[0]
        return (
            f"{Path(self.name) / METRICS}: {len(self.skipped)} malformed record(s) left out of the plot, the first "
            f"on line {line} ({problem})"
        )


CURVE_VALUES = ("loss", "ppl", "bpc")
"""A record's values drawn as curves: numbers, where NaN or infinity (a diverged step, as the trainer logs it) is
a gap in the curve."""
AXIS_VALUES = ("tokens", "wall_time", "step_time_s")
"""A record's values that place its step on the x axes: finite numbers, at least 0. The training records'
`THROUGHPUT` figures are numbers too (``mfu`` may be null: no peak known); NaN or infinity is a gap."""
SCALARS = (str, int, float, bool, type(None))


MAX_STEP = 2**53
"""Steps are whole numbers below 2^53, which a float (an axis) holds exactly."""


def _is_number(value) -> bool:
    """An int or float (not a bool) that a float can hold: JSON's integers have no bound."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _record_problem(record) -> str | None:
    """What makes a decoded metrics.jsonl line unusable for the plot (the types of every field it reads), or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    kind, step = record.get("kind"), record.get("step")
    if not isinstance(kind, str):
        return f"'kind' is {kind!r}, not a string"
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_STEP:
        return f"'step' is {step!r}, not a whole number >= 0 (and below 2^53)"
    drawn = (*CURVE_VALUES, *AXIS_VALUES, *(THROUGHPUT if kind == "train" else ()))
    for name in drawn if kind in ("train", "eval") else AXIS_VALUES:
        value = record.get(name)
        if name in THROUGHPUT and value is None:  # mfu is null where no peak is known
            continue
        if name in record and not _is_number(value):
            return f"'{name}' is {value!r}, not a number"
        if name in AXIS_VALUES and name in record and not (math.isfinite(value) and value >= 0):
            return f"'{name}' is {value!r}, not a finite number >= 0"
    if kind == "numerics":
        event = record.get("event")
        if not isinstance(event, str):
            return f"'event' is {event!r}, not a string"
        for name in ("from_step", "to_step") if event == "skip" else ():
            value = record.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_STEP:
                return f"'{name}' is {value!r}, not a whole number >= 0 (and below 2^53)"
    hparams = record.get("hparams", {})
    if kind == "start" and not (isinstance(hparams, dict) and all(isinstance(v, SCALARS) for v in hparams.values())):
        return "'hparams' is not a mapping of names to numbers or strings"
    return None


def _records(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """The usable records of a metrics.jsonl, and the malformed ones left out (line number, what is wrong). The
    last line cut short by a kill (no line end) is no record at all, and is left out without a word."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would be read forever, a device without end
            raise PlotError(f"{path}: not a regular file (not a metrics.jsonl written by launchers/train.py)")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlotError(f"{path}: no such file (not a run directory of launchers/train.py?)") from None
    except UnicodeDecodeError:
        raise PlotError(f"{path}: not UTF-8 text (not a metrics.jsonl written by launchers/train.py)") from None
    except OSError as error:
        raise PlotError(describe_os_error(error, path)) from None
    lines = text.splitlines()
    records, skipped = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines) or text.endswith("\n"):
                skipped.append((number, "not a JSON record"))
            continue
        problem = _record_problem(record)
        if problem is None:
            records.append(record)
        else:
            skipped.append((number, problem))
    return records, skipped


def _number(value) -> float:
    """A logged value as a float; NaN (a gap in the curve) for one that is missing or not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _training_time(records: list[dict], train: dict[int, dict]) -> dict[int, float]:
    """Seconds of training up to each step: the time within each start, without the gaps between starts."""
    if not all(math.isfinite(_number(r.get("wall_time"))) for r in records):  # older runs: the logged step times
        if not any(math.isfinite(_number(r.get("step_time_s"))) for r in train.values()):
            return {}  # no time logged at all: the time axis has no values
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
    records, skipped = _records(directory / METRICS)
    by_kind: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    hparams: dict = {}
    rollbacks, windows = [], []
    for record in records:
        if record["kind"] in by_kind:
            by_kind[record["kind"]][record["step"]] = record
        elif record["kind"] == "start" and "hparams" in record:
            hparams = record["hparams"]
        elif record["kind"] == "numerics" and record["event"] == "rollback":
            rollbacks.append(record["step"])
        elif record["kind"] == "numerics" and record["event"] == "skip":
            windows.append((record["from_step"], record["to_step"]))
    train, evals = by_kind["train"], by_kind["eval"]
    if not train:
        left_out = (
            f" ({len(skipped)} malformed record(s) left out, the first on line {skipped[0][0]})" if skipped else ""
        )
        raise PlotError(f"{directory / METRICS}: no training step logged yet{left_out}")
    character_level = all("bpc" in r for r in train.values())
    # From the last training record that logged its tokens (none: the tokens axis has no values)
    counted = [r for r in train.values() if math.isfinite(_number(r.get("tokens")))]
    last = max(counted, key=lambda r: r["step"]) if counted else {"step": 1}
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

    run = Run(str(directory), curve(train), curve(evals), x, hparams, character_level, skipped)
    run.rollbacks, run.skipped_windows = sorted(set(rollbacks)), sorted(set(windows))
    return run


def _matplotlib():
    """(pyplot, Line2D) of matplotlib drawing to files only (the Agg backend: no display on a login node); an
    ImportError where the extra is not installed."""
    import matplotlib  # optional dependency: pip install 'txl_dist[plot]'

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (it imports matplotlib.lines too)

    return plt, matplotlib.lines.Line2D


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
COLORS = 10
"""matplotlib's tab10 palette; a run's colour, line style and marker: `run_style`."""
DISTINCT_STYLES = COLORS * len(LINE_STYLES) * len(MARKERS)
"""How many runs get a look of their own (280): the colour repeats every 10 runs, the line style every 40, the
marker every 7, and 40 and 7 share no factor."""
PANEL_INCHES = (5.2, 3.6)
"""Width and height of one panel; the figure grows by the legend's rows below the panels."""
LEGEND_FONT_SIZE = 9


def run_style(index: int, palette: Sequence) -> dict[str, str | tuple]:
    """The colour (of the `COLORS` of ``palette``), line style and marker of the ``index``-th run: no two of the
    first `DISTINCT_STYLES` alike, and runs next to each other differ in colour and marker."""
    return {
        "color": palette[index % COLORS],
        "linestyle": LINE_STYLES[index // COLORS % len(LINE_STYLES)],
        "marker": MARKERS[index % len(MARKERS)],
    }


def figure_of(runs: Sequence[Run], axes: Sequence[str]):
    """The matplotlib figure: rows loss and ppl/bpc, one column per x axis, and below them a legend of every run
    (its colour, line style and marker) sized to the run count, outside the panels."""
    plt, Line2D = _matplotlib()
    second = "bpc" if all(run.character_level for run in runs) else "ppl"
    longest = max((t for run in runs for t in run.x["time"].values() if math.isfinite(t)), default=0.0)
    unit, per_unit = next((u for u in (("hours", 3600.0), ("minutes", 60.0)) if longest >= 2 * u[1]), ("seconds", 1.0))
    width, height = PANEL_INCHES
    figure = plt.figure(figsize=(width * len(axes), 3 * height), layout="constrained")
    grid = figure.subplots(3, len(axes), squeeze=False, sharex="col")
    styles = [run_style(index, plt.colormaps["tab10"].colors) for index in range(len(runs))]
    for run, style in zip(runs, styles):
        for column, axis in enumerate(axes):
            scale = per_unit if axis == "time" else 1.0
            for row, metric in enumerate(("loss", second)):
                _draw_curves(grid[row][column], run, style, axis, metric, scale)
                _mark_faults(grid[row][column], run, style, axis, scale)
    for column, axis in enumerate(axes):
        throughput_panel(
            grid[2][column], runs, [run.x[axis] for run in runs], per_unit if axis == "time" else 1, styles
        )
        for row, metric in enumerate(("loss", second, "tokens_per_s")):
            gap = panel_gap(runs, axis, metric)
            if gap is not None:  # the panel stays, empty, and says why
                grid[row][column].text(
                    0.5, 0.5, gap, transform=grid[row][column].transAxes, ha="center", va="center", color="gray"
                )
        grid[2][column].set_xlabel(f"{AXES[axis]} ({unit})" if axis == "time" else AXES[axis])
        for row, metric in enumerate(("loss", second)):
            grid[row][column].set_ylabel({"loss": "loss (nats/token)", "ppl": "perplexity", "bpc": "bits/char"}[metric])
            grid[row][column].grid(True, alpha=0.3)
        if second == "ppl":
            grid[1][column].set_yscale("log")
    handles = [Line2D([], [], linewidth=1.5, markerfacecolor="none", **style) for style in styles]
    handles += [
        Line2D([], [], color="gray", marker="o", markerfacecolor="none"),
        Line2D([], [], color="gray", marker="o", linestyle="none"),
    ]
    labels = [run.label() for run in runs] + ["training", "evaluation"]
    if any(run.rollbacks for run in runs):
        handles.append(Line2D([], [], color="gray", linestyle=":"))
        labels.append("rolled back (numerical fault)")
    if any(run.skipped_windows for run in runs):
        handles.append(plt.Rectangle((0, 0), 1, 1, color="gray", alpha=0.2, linewidth=0))
        labels.append("data window skipped")
    _legend_below(figure, handles, labels)
    return figure


def _mark_faults(plot, run: Run, style: dict, axis: str, scale: float) -> None:
    """The run's rolled-back steps (a dotted line) and skipped data windows (a shaded span), in its colour."""
    for step in run.rollbacks:
        x = run.x_at(axis, step) / scale
        if math.isfinite(x):
            plot.axvline(x, color=style["color"], linestyle=":", linewidth=1.0, alpha=0.8)
    for first, last in run.skipped_windows:
        start, end = run.x_at(axis, first) / scale, run.x_at(axis, last) / scale
        if math.isfinite(start) and math.isfinite(end):
            plot.axvspan(start, max(end, start), color=style["color"], alpha=0.15, linewidth=0)


def _draw_curves(plot, run: Run, style: dict, axis: str, metric: str, scale: float) -> None:
    """Training as the run's line with its marker every tenth of the panel, evaluations as its filled marker."""
    for curve, look in (
        (run.train, {**style, "linewidth": 1.2, "markevery": 0.1, "markerfacecolor": "none", "markersize": 5}),
        (run.eval, {**style, "linestyle": "none", "markersize": 5}),
    ):
        x = [run.x[axis][s] / scale for s in curve.steps]
        if _has_point(x, curve.values[metric]):  # matplotlib's markevery fails on a line of no point
            plot.plot(x, curve.values[metric], **look)


AXIS_FIELDS = {"step": "step", "tokens": "tokens", "time": "wall_time or step_time_s"}
"""The fields of the training records that each x axis is made of."""


def _has_point(xs: Sequence[float], ys: Sequence[float]) -> bool:
    """Whether the line of ``xs`` against ``ys`` has a point to draw (both finite somewhere)."""
    return any(math.isfinite(x) and math.isfinite(y) for x, y in zip(xs, ys))


def panel_gap(runs: Sequence[Run], axis: str, metric: str) -> str | None:
    """Why the panel of ``metric`` against ``axis`` has nothing to draw (no run logged the one or the other, or
    no step logged both), as the note the panel shows; None when some run has a point there."""
    curves = [(run, curve) for run in runs for curve in (run.train, run.eval) if curve.steps]
    xs = [[run.x[axis][s] for s in curve.steps] for run, curve in curves]
    ys = [curve.values[metric] for _, curve in curves]
    if any(_has_point(x, y) for x, y in zip(xs, ys)):
        return None
    if not any(math.isfinite(v) for x in xs for v in x):
        return f"no {AXIS_FIELDS[axis]} logged"
    if not any(math.isfinite(v) for y in ys for v in y):
        return f"no {metric} logged"
    return f"no step logged both {AXIS_FIELDS[axis]} and {metric}"


def empty_panels(runs: Sequence[Run], axes: Sequence[str]) -> list[str]:
    """One line for each x axis that no run logged, and for each loss or ppl/bpc panel with nothing to draw
    (`panel_gap`), for the command's warnings. The throughput row's note is in the picture only: runs logged
    before those figures existed have none."""
    second = "bpc" if all(run.character_level for run in runs) else "ppl"
    lines = []
    for axis in axes:
        if not any(math.isfinite(v) for run in runs for v in run.x[axis].values()):
            lines.append(f"the panels against {AXES[axis]} are empty: no {AXIS_FIELDS[axis]} logged")
            continue
        lines += [
            f"the {metric} panel against {AXES[axis]} is empty: {gap}"
            for metric in ("loss", second)
            if (gap := panel_gap(runs, axis, metric)) is not None
        ]
    return lines


def _legend_below(figure, handles: list, labels: list[str]) -> None:
    """The legend below the panels in as many columns as its widest entry allows (the figure as wide as that entry
    at least), the figure made taller by its height, so that it covers no panel whatever the number of runs
    (constrained layout keeps the room)."""
    renderer = figure.canvas.get_renderer()
    look = {"fontsize": LEGEND_FONT_SIZE, "frameon": False, "numpoints": 1}
    probe = figure.legend(handles, labels, **look)
    entry_width = probe.get_window_extent(renderer).width / figure.dpi
    probe.remove()
    figure.set_figwidth(max(figure.get_figwidth(), entry_width / 0.95))  # one panel, a long run name
    columns = max(1, min(len(labels), int(0.95 * figure.get_figwidth() // entry_width)))
    legend = figure.legend(handles, labels, loc="outside lower center", ncol=columns, **look)
    legend_inches = legend.get_window_extent(renderer).height / figure.dpi
    figure.set_figheight(figure.get_figheight() + legend_inches + 0.3)


def draw(runs: Sequence[Run], axes: Sequence[str]) -> bytes:
    """The picture (`figure_of`) as PNG bytes."""
    plt, _ = _matplotlib()
    figure = figure_of(runs, axes)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def throughput_panel(
    plot, runs: Sequence[Run], xs: Sequence[dict[int, float]], per_unit: float, styles: Sequence[dict]
) -> None:
    """Training tokens/s of each run (solid, left axis) and its MFU in percent (dotted, right axis), in the run's
    colour and marker (`run_style`); the model TFLOPS per rank instead of the MFU when a run has none (no known
    peak: a CPU without train.peak_tflops). Runs logged before these figures existed draw tokens/s only."""
    use_mfu = all(any(math.isfinite(v) for v in run.train.values["mfu"]) for run in runs)
    right = plot.twinx()
    for run, x, style in zip(runs, xs, styles):
        look = {"color": style["color"], "marker": style["marker"], "markevery": 0.1, "markerfacecolor": "none"}
        at = [x[s] / per_unit for s in run.train.steps]
        second = [100 * v for v in run.train.values["mfu"]] if use_mfu else run.train.values["tflops"]
        for axis, values, line in ((plot, run.train.values["tokens_per_s"], "-"), (right, second, ":")):
            if _has_point(at, values):  # a run logged before these figures has none
                axis.plot(at, values, linewidth=1.2, linestyle=line, markersize=4, **look)
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
        axes = list(AXES) if args.x == "all" else [args.x]
        for warning in [*filter(None, (run.skipped_warning() for run in runs)), *empty_panels(runs, axes)]:
            print(f"plot: warning: {warning}", file=sys.stderr)
        picture = draw(runs, axes)
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
