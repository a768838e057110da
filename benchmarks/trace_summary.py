"""Where the time of profiled steps went, from the Chrome traces that ``profile.steps=[A, B]`` writes.

    python benchmarks/trace_summary.py RUN/profile/steps_41-50/rank_0.pt.trace.json [OTHER.pt.trace.json ...]
        [--top 15]

For each trace: the milliseconds per step of each phase of the loop (txl_dist/data, forward, backward, ...), then
the operators with the most self time (their own time, without the operators they called) and the phase they
ran in. Several traces (two dtypes, two configs) are printed side by side, so that a change shows as a ratio.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from txl_dist.exit_status import run_command  # noqa: E402 -- the project's error policy
from txl_dist.fileio import read_json  # noqa: E402

PHASE_PREFIX = "txl_dist/"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _events(path: Path) -> list[dict]:
    """The complete events ("ph": "X") of a Chrome trace; ValueError naming the file when it is no trace."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file (profile.steps writes RUN/profile/steps_A-B/*.json)")
    advice = "; give a trace that profile.steps wrote (RUN/profile/steps_A-B/rank_R.pt.trace.json)"
    trace = read_json(path, ValueError, "not a Chrome trace: unreadable or cut short", advice)
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no list of traceEvents){advice}")
    return [
        event
        for event in events
        if isinstance(event, dict)
        and event.get("ph") == "X"
        and isinstance(event.get("name"), str)
        and _is_number(event.get("dur"))
        and _is_number(event.get("ts"))
    ]


def summarise(path: Path) -> dict:
    """{"steps": n, "phases": {name: ms per step}, "ops": Counter(op -> self ms per step), "op_phase": {...}}."""
    events = _events(path)
    steps = sum(1 for e in events if e["name"].startswith(PHASE_PREFIX + "step "))
    phases: Counter = Counter()
    for event in events:
        name = event["name"]
        if name.startswith(PHASE_PREFIX) and not name.startswith(PHASE_PREFIX + "step "):
            phases[name.removeprefix(PHASE_PREFIX)] += event["dur"] / 1000
    self_ms: Counter = Counter()
    op_phase: dict[str, Counter] = defaultdict(Counter)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        by_thread[(event.get("pid"), event.get("tid"))].append(event)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for event in thread_events:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            event["_self"] = event["dur"]
            event["_phase"] = next(
                (
                    s["name"].removeprefix(PHASE_PREFIX)
                    for s in reversed(stack)
                    if s["name"].startswith(PHASE_PREFIX) and not s["name"].startswith(PHASE_PREFIX + "step ")
                ),
                "-",
            )
            if stack:
                stack[-1]["_self"] -= event["dur"]
            stack.append(event)
    for event in events:
        if event.get("cat") in ("cpu_op", "kernel", "gpu_memcpy") and not event["name"].startswith(PHASE_PREFIX):
            self_ms[event["name"]] += max(event["_self"], 0) / 1000
            op_phase[event["name"]][event["_phase"]] += max(event["_self"], 0) / 1000
    per_step = max(steps, 1)
    return {
        "steps": steps,
        "phases": {name: ms / per_step for name, ms in phases.items()},
        "ops": Counter({name: ms / per_step for name, ms in self_ms.items()}),
        "op_phase": {name: counts.most_common(1)[0][0] for name, counts in op_phase.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="operators shown (default 15)")
    args = parser.parse_args(argv)
    summaries = [summarise(path) for path in args.traces]
    labels = [f"[{i}]" for i in range(len(summaries))]
    for label, path, summary in zip(labels, args.traces, summaries):
        print(f"{label} {path} ({summary['steps']} steps)")
    ratio = " / ".join(f"[{i}]" for i in range(1, len(summaries))) and "  ratio to [0]"
    print(f"\nms per step by phase{ratio}")
    phase_names = list(dict.fromkeys(name for s in summaries for name in s["phases"]))
    for name in phase_names:
        values = [s["phases"].get(name, 0.0) for s in summaries]
        ratios = "".join(f"  {v / values[0]:.2f}x" if values[0] else "" for v in values[1:])
        print(f"  {name:<20}" + "".join(f"{v:>10.2f}" for v in values) + ratios)
    print(f"\noperators by self time, ms per step (top {args.top} of {labels[0]}, and the same in the others)")
    for name, _ in summaries[0]["ops"].most_common(args.top):
        values = [s["ops"].get(name, 0.0) for s in summaries]
        ratios = "".join(f"  {v / values[0]:.2f}x" if values[0] else "" for v in values[1:])
        phase = summaries[0]["op_phase"].get(name, "-")
        print(f"  {name[:44]:<44} {phase[:18]:<18}" + "".join(f"{v:>9.2f}" for v in values) + ratios)
    for label, summary in zip(labels[1:], summaries[1:]):
        extra = [name for name, _ in summary["ops"].most_common(args.top) if name not in summaries[0]["ops"]]
        for name in extra:
            print(f"  {label} only: {name[:44]:<44} {summary['ops'][name]:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "trace_summary.py"))
