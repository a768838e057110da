"""benchmarks/trace_summary.py, which docs/profiling.md recommends: a trace it cannot read is one line and status
2 (ts_trunc, ts_list, ts_missing gave tracebacks), and a trace of profiled steps is summarised."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launcher import REPO


def summary(*paths) -> subprocess.CompletedProcess:
    command = [sys.executable, "benchmarks/trace_summary.py", *map(str, paths)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


TRACE = {
    "traceEvents": [
        {"ph": "X", "name": "txl_dist/step 3", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
        {"ph": "X", "name": "txl_dist/forward", "ts": 0, "dur": 600, "pid": 1, "tid": 1},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 10, "dur": 400, "pid": 1, "tid": 1},
        {"ph": "X", "name": "broken", "ts": "soon", "dur": 5},  # a malformed event is passed over
        {"ph": "i", "name": "instant", "ts": 5},
    ]
}


@pytest.mark.parametrize(
    "content, said",
    [
        (json.dumps(TRACE)[:40], "not a Chrome trace: unreadable or cut short"),
        ("[1, 2]", "not a Chrome trace (no list of traceEvents)"),
        ('{"traceEvents": {"a": 1}}', "not a Chrome trace (no list of traceEvents)"),
        (None, "no such trace file"),
    ],
    ids=["truncated", "list", "foreign", "missing"],
)
def test_a_trace_it_cannot_read_is_one_line(content, said, tmp_path):
    trace = tmp_path / "rank_0.pt.trace.json"
    if content is not None:
        trace.write_text(content)
    result = summary(trace)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"trace_summary.py: error: {trace}: {said}")


def test_a_trace_of_profiled_steps_is_summarised(tmp_path):
    trace = tmp_path / "rank_0.pt.trace.json"
    trace.write_text(json.dumps(TRACE))
    result = summary(trace)
    assert result.returncode == 0, result.stderr
    assert "(1 steps)" in result.stdout and "forward" in result.stdout and "aten::mm" in result.stdout
