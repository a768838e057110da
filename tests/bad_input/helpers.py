"""Helpers shared by the bad-input tests: the one line of a refused command, the run arguments of
launchers/train.py parsed in this process, and a launcher's main run in this process and sent a real signal."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from tests.launcher import REPO

TINY = REPO / "configs" / "tiny_cpu.yaml"


def _one_line(result, *needles: str) -> str:
    """The single stderr line of a refused command, holding every needle."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if "warning" not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _parse_run(*overrides: str):
    from txl_dist.training.startup import parse_run_args

    return parse_run_args(["--config", "configs/tiny_cpu.yaml", *overrides], world_size=2, device="cpu")


class _SignalEscaped(Exception):
    """SIGTERM reached the test's handler: the launcher under test did not handle it."""


def _escaped(signum, frame):
    raise _SignalEscaped(signal.Signals(signum).name)


def _signalled_in_process(script: str, args: list[str], ready: Callable[[str, str], bool], signum: int = signal.SIGINT):
    """``script``'s main(args) in this process, sent a real ``signum`` as soon as ``ready(stdout, stderr)`` (what
    it has printed so far); (exit status, stdout, stderr)."""
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    out, err = io.StringIO(), io.StringIO()
    running, sent = threading.Event(), threading.Event()

    def send_when_ready() -> None:
        deadline = time.monotonic() + 120
        while running.is_set() and time.monotonic() < deadline:
            if ready(out.getvalue(), err.getvalue()):
                sent.set()
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.002)

    # A background job starts with SIGINT ignored, which this process may have inherited: Ctrl-C's own handler.
    # SIGTERM's default would end the test session: a handler that fails the test unless main() has its own.
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, _escaped),
    }
    running.set()
    sender = threading.Thread(target=send_when_ready, daemon=True)
    sender.start()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = module.main(args)
    except (KeyboardInterrupt, _SignalEscaped):  # a traceback for the user; here it would end the test session
        pytest.fail(f"{script}: the signal escaped main():\n{err.getvalue()[-2000:]}")
    finally:
        running.clear()
        sender.join()
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert sent.is_set(), f"{script} ended before it was ready to be interrupted:\n{err.getvalue()[-2000:]}"
    return status, out.getvalue(), err.getvalue()


def _last_line_only(stderr: str, line: str) -> None:
    """``stderr`` ends with ``line``, and holds no traceback (a progress bar may come before it)."""
    assert "Traceback" not in stderr and stderr.rstrip("\n").split("\n")[-1] == line, stderr[-2000:]
