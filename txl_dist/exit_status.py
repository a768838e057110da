"""The one error policy of every command, and the start-up path that applies it: `run_command`.

Every command's ``__main__`` block is ``sys.exit(run_command(main, "PROG"))`` (launchers/, data_tools/,
``python -m txl_dist.plan``, ``python -m txl_dist.plot``, ``python -m txl_dist.rendezvous.launch_env``,
``python -m txl_dist.rendezvous.process_group``, ``python -m txl_dist.supervision.slurm_nodes``). Its statuses:

- 0: done, or the answer is yes.
- `USAGE_ERROR` (2): a refused command line or input, a bad file, key or value, with one line ``PROG: error:
  MESSAGE`` naming it, before any work that matters; argparse's own refusals (an unknown flag, a missing
  argument) print its usage line first, as every argparse tool does.
- `FAILURE` (1): a runtime failure, the command stopped by its surroundings (no space, a read-only output, a
  worker or rank that died, a stalled rank): one line when the cause is known.
- `VERDICT` (3): the command worked and its answer is no: ``python -m data_tools.inspect_shards --verify`` found
  problems in the shards, ``python -m txl_dist.plan`` found that the layout does not fit ``--device-memory``. A
  status of its own, so that a job script tells "the shards are damaged" from "the check could not run".
- `NUMERICAL_FAULT` (4): a training run stopped by its own numbers: a loss or gradient norm that stayed non-finite
  or spiking after the rollbacks its numerics settings allow (`txl_dist.training.numerics`), or a resumed
  checkpoint whose weights give a non-finite loss. A relaunch would meet it again, so the Slurm batch script never
  retries it; the newest healthy checkpoint is kept, and the one line names it.
- `INTERRUPTED` (130, 128 + SIGINT) after Ctrl-C, 128 + the signal after SIGTERM or SIGHUP where a command turns
  those into an interrupt (`txl_dist.supervision.interrupts`): one line.

What `run_command` does with an exception that ``main`` lets out:

- ValueError (and its subclasses: ConfigError, ManifestError, TokenizerError, CheckpointError, InputError,
  LaunchError, ...) is this project's error of input: each is raised with one line that names the file, key or
  value, so it is printed as that line with status 2.
- OSError is printed as one line naming the path and the cause in words (`txl_dist.fileio.describe_os_error`). A
  path that the user named wrongly (no such file, a file where a folder should be and the reverse, a name that
  is taken, a link loop, a name too long) is an input error, 2; anything else (no space, a read-only file system,
  permission denied, an I/O error) is a failure of the surroundings, 1 (`os_error_status`).
- `CommandFailure` (a runtime failure whose message says everything: a worker process that died) is one line, 1.
- KeyboardInterrupt is one line, ``PROG: interrupted``, and `INTERRUPTED`.
- A stdout whose reader has gone (``PROG | head -1``) is the reader's choice, not a failure: the command ends
  there, quietly (no line, no traceback), with status 0, or with the status ``main`` returned when only the last
  buffered lines found the pipe closed (`StdoutClosed`). A broken pipe of anything else (a worker's) stays an
  OSError, a failure.
- Any other exception is a bug, ours or a library's: its traceback is printed, then one line naming it, and the
  status is 1. A user who meets one reports it, and the traceback is what the report needs; the errors a user
  can act on are all of the kinds above and need none.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from txl_dist.fileio import describe_os_error

FAILURE = 1
"""Exit status of a runtime failure: a command stopped by its surroundings (no space, a read-only output, a
worker that died)."""
USAGE_ERROR = 2
"""Exit status of a refused command line or input (what argparse exits with for a bad flag)."""
VERDICT = 3
"""Exit status of a command that worked and answers no: shards with problems (``inspect_shards --verify``), a
layout that does not fit (``python -m txl_dist.plan --device-memory``)."""
NUMERICAL_FAULT = 4
"""Exit status of a training run stopped by its own numbers (a fault that its rollbacks did not cure): never
retried by the Slurm batch script (`txl_dist.supervision.relaunch`)."""
INTERRUPTED = 128 + signal.SIGINT
"""Exit status after Ctrl-C (130), as a shell reports it."""

INPUT_OS_ERRORS: tuple[type[OSError], ...] = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)
"""The OSErrors whose cause lies in the path a user gave: a refused input (status 2), not a failure. Told by class,
which Python picks from the errno (ENOENT, ENOTDIR, EISDIR, EEXIST) and which a message of this project's own
(``FileNotFoundError(f"{path}: missing (...)")``) has without one."""
INPUT_ERRNOS = frozenset({errno.ELOOP, errno.ENAMETOOLONG})
"""The errnos, of no class of their own, that are input errors too: a loop of symbolic links, a name too long."""


class CommandFailure(RuntimeError):
    """A runtime failure whose message says all a user needs (no traceback): printed as one line, status 1."""


class ReportedByRankZero(Exception):
    """A failure every rank found alike before the failure channel existed (`txl_dist.supervision.guard`); rank 0 prints
    it, the others end with status 1 without a word."""


class StdoutClosed(BaseException):
    """A write to stdout found its reader gone (``| head``). Not an Exception, so that no command's handler of
    OSError (or of every Exception) reports it as a failure: `run_command` ends the command quietly."""


class _WatchedStdout:
    """``sys.stdout`` while `run_command` runs a command: a write or flush that finds the pipe closed points the
    descriptor at /dev/null (so that no later flush, the interpreter's at exit included, fails again) and raises
    `StdoutClosed`; everything else is the stream's own."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text)

    def writelines(self, lines) -> None:
        self._guarded(self._stream.writelines, lines)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _guarded(self, operation: Callable, *args):
        try:
            return operation(*args)
        except BrokenPipeError:
            _point_at_devnull(self._stream)
            raise StdoutClosed from None


def _point_at_devnull(stream) -> None:
    """The standard recipe for a closed stdout: its descriptor now writes to /dev/null (a stream without a
    descriptor, a test's capture, is left as it is)."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def one_line(message: object) -> str:
    """``message`` on one line: the lines of a message that spans several, joined by spaces."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def error_line(prog: str, message: object) -> str:
    """The line of every refusal and known failure: ``PROG: error: MESSAGE``."""
    return f"{prog}: error: {one_line(message)}"


def print_error(prog: str, message: object) -> None:
    """`error_line` on stderr (quietly nothing when stderr is gone: the status still tells)."""
    try:
        print(error_line(prog, message), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def refuse(prog: str, message: object) -> NoReturn:
    """Print `error_line` and exit with `USAGE_ERROR`, as a refused flag does (for the refusals found while the
    command line is read, by code that callers and tests expect to exit as argparse does)."""
    print_error(prog, message)
    raise SystemExit(USAGE_ERROR)


def os_error_status(error: OSError) -> int:
    """`USAGE_ERROR` for an OSError whose cause is the path a user gave (`INPUT_OS_ERRORS`, `INPUT_ERRNOS`), else
    `FAILURE`."""
    return USAGE_ERROR if isinstance(error, INPUT_OS_ERRORS) or error.errno in INPUT_ERRNOS else FAILURE


def describe_error(error: BaseException) -> str:
    """The one-line text of an error that says everything: an OSError with its path and cause, else its message."""
    if isinstance(error, OSError):
        return describe_os_error(error)
    return one_line(error)


def exit_status(error: BaseException) -> int:
    """The status of the policy for ``error`` (see the module docstring)."""
    if isinstance(error, KeyboardInterrupt):
        return 128 + getattr(error, "signum", signal.SIGINT)
    if isinstance(error, ValueError):
        return USAGE_ERROR
    if isinstance(error, OSError):
        return os_error_status(error)
    return FAILURE


def run_command(main: Callable[..., int | None], prog: str, argv: list[str] | None = None) -> int:
    """Run a command's ``main`` (with ``argv``, when given) and return its exit status under the policy of the
    module docstring: what ``main`` returns, the code of a SystemExit it raises (argparse's 2), or the status of
    the exception it lets out, printed as one line (with the traceback before it for a bug); 0 when stdout's
    reader left before ``main`` finished. What stdout still buffers is written here, under the policy, not by the
    interpreter's exit (where a closed pipe would be a traceback and status 120)."""
    stdout = sys.stdout
    sys.stdout = _WatchedStdout(stdout)
    status = 0  # what stands when stdout's reader leaves before main has finished
    try:
        status = _status_of(main, prog, argv)
        sys.stdout.flush()
    except StdoutClosed:
        pass  # quietly: the reader's choice
    finally:
        sys.stdout = stdout
    return status


def _status_of(main: Callable[..., int | None], prog: str, argv: list[str] | None) -> int:
    try:
        status = main() if argv is None else main(argv)
    except SystemExit as exited:
        if exited.code is None or isinstance(exited.code, int):
            return exited.code or 0
        raise  # a message as the code: Python prints it and exits 1
    except KeyboardInterrupt as stop:
        try:
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        return exit_status(stop)
    except (ValueError, OSError, CommandFailure) as error:
        print_error(prog, describe_error(error))
        return exit_status(error)
    except Exception as error:  # noqa: BLE001 -- a bug: its traceback, then the one line that names it
        traceback.print_exc()
        print_error(prog, f"internal error ({type(error).__name__}: {error}); the traceback above is for a bug report")
        return FAILURE
    return status or 0
