"""Ctrl-C, SIGTERM and SIGHUP at a command line: one line and the shell's exit status, never a traceback.

`one_line_on_stop` wraps a command's ``main``: SIGINT raises KeyboardInterrupt as usual, SIGTERM and SIGHUP (unless
ignored, as under ``nohup``) raise `Stopped`, a KeyboardInterrupt too, so that the ``finally`` blocks and the
``except BaseException`` clean-ups of the writers run (`txl_dist.fileio`'s atomic files and staged folders: nothing
half-written is left). The command then prints ``PROG: interrupted; OUTCOME`` (or ``stopped by SIGTERM``) once and
returns 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a process that the signal
ended. The training loop has its own answer to these signals (a checkpoint first, `txl_dist.supervision.guard`).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

GRACE_S = 10.0
"""After `stop_this_process`: how long the main thread may take to stop before the process is ended without it."""

_reason: str | None = None
"""Why `stop_this_process` sent this process its SIGTERM (None for a SIGTERM from outside)."""


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt; ``reason`` says why when
    this process stopped itself (`stop_this_process`)."""

    def __init__(self, signum: int, reason: str | None = None):
        super().__init__(reason or signal.Signals(signum).name)
        self.signum = signum
        self.reason = reason


def exit_status(stop: KeyboardInterrupt) -> int:
    """128 + the signal's number: what a shell reports for a process ended by it."""
    return 128 + (stop.signum if isinstance(stop, Stopped) else signal.SIGINT)


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum, _reason if signum == signal.SIGTERM else None)


def stop_this_process(reason: str, grace_s: float = GRACE_S) -> None:
    """From a thread other than the main one: stop the main thread as SIGTERM does, ``reason`` printed in place
    of the signal's name; if the process still runs ``grace_s`` seconds later (its main thread blocked in C code, a
    collective whose peers are gone), end it with status 143 without it."""
    global _reason
    _reason = reason
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    _flush_outputs()
    os._exit(128 + signal.SIGTERM)


def _flush_outputs() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While the block runs (in the main thread): SIGTERM and SIGHUP raise `Stopped`; the previous handlers are
    restored after it."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) == signal.SIG_IGN:
                continue  # nohup, or a parent that asked this process to survive it
            previous[signum] = signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _is_first_rank() -> bool:
    """Whether this process prints for all (rank 0, or no launcher's rank at all)."""
    return os.environ.get("RANK", "0") == "0"


def report_stop(prog: str, stop: KeyboardInterrupt, outcome: str) -> int:
    """Print the one line of a stopped command (on rank 0 only: a terminal's Ctrl-C reaches every rank) and
    return its exit status."""
    if not isinstance(stop, Stopped):
        what = "interrupted"
    else:
        what = f"stopped: {stop.reason}" if stop.reason else f"stopped by {signal.Signals(stop.signum).name}"
    if _is_first_rank():
        try:
            print(f"{prog}: {what}; {outcome}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # the reader of our output is gone: the exit status still tells
            pass
    return exit_status(stop)


def _process_group_left() -> bool:
    distributed = sys.modules.get("torch.distributed")
    return distributed is not None and distributed.is_available() and distributed.is_initialized()


def one_line_on_stop(prog: str, outcome: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a command's ``main(argv)``: a stop signal during it ends it with `report_stop`'s line and status.

    ``outcome`` says what the interruption leaves (``"no result written"``). A process still in a process group
    (a rank stopped between two collectives) leaves at once with `os._exit`: tearing down a group whose peers are
    going too can hang or abort the interpreter.
    """

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapped(*args: Any, **kwargs: Any) -> int:
            try:
                with stop_signals_raise():
                    return main(*args, **kwargs)
            except KeyboardInterrupt as stop:
                status = report_stop(prog, stop, outcome)
                if _process_group_left():
                    _flush_outputs()
                    os._exit(status)
                return status

        return wrapped

    return decorate
