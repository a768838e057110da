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
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from txl_dist.exit_status import USAGE_ERROR, os_error_status, run_command
from txl_dist.fileio import atomic_write, describe_os_error
from txl_dist.plot_records import PlotError, Run, read_run

__all__ = ["AXES", "PlotError", "Run", "draw", "figure_of", "main", "read_run"]

AXES = {"step": "optimizer step", "tokens": "tokens seen", "time": "training time"}


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
