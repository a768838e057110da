"""Running the shipped launchers for real from tests: `deepspeed` on 2 CPU ranks, and reading what a run wrote."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
# The launcher installed beside this interpreter (a virtual environment), else the one on PATH.
_BESIDE = Path(sys.executable).parent / "deepspeed"
DEEPSPEED = str(_BESIDE) if _BESIDE.exists() else (shutil.which("deepspeed") or str(_BESIDE))
CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


PORTS_USED: set[int] = set()
"""The master ports handed out in this session: the names of DeepSpeed's shared-memory buffers carry them, and
the test fixture removes only those buffers (not the live ones of other test sessions on the machine)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    PORTS_USED.add(port)
    return port


def launcher_command(script: str, args: list[str], nprocs: int = 2, launcher_flags: list[str] | None = None) -> list[str]:
    flags = launcher_flags if launcher_flags is not None else ["--num_gpus", str(nprocs), "--master_port", str(free_port())]
    return [DEEPSPEED, *flags, script, *args]


def environment() -> dict[str, str]:
    return {**os.environ, **CPU_ENV}


def run(command: list[str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}:\n{tail(result)}")
    return result


def in_process(script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """A launcher's ``main(argv)`` called in this process, its output captured: for the launchers that start no
    process group when no launcher environment is set (evaluate, generate, convert on one rank), which saves a
    Python start and the imports of torch and DeepSpeed per call. A launcher that exits (argparse) counts as its
    exit status."""
    import contextlib
    import importlib
    import io

    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = module.main(list(args))
        except SystemExit as exited:
            status = exited.code if isinstance(exited.code, int) else 1
    result = subprocess.CompletedProcess([script, *args], status, out.getvalue(), err.getvalue())
    if check and status != 0:
        pytest.fail(f"{script} {' '.join(args)} returned {status}:\n{result.stderr[-3000:]}")
    return result


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def tail(result, lines: int = 60) -> str:
    text = (result.stdout or "") + (result.stderr or "")
    return "\n".join(text.splitlines()[-lines:])


def records(output_dir: Path, kind: str = "train") -> dict[int, dict]:
    """metrics.jsonl of a run: step -> record of the given kind."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if record.get("kind") == kind:
            out[record["step"]] = record
    return out


def wait_for_step(output_dir: Path, step: int, process: subprocess.Popen, timeout: float = 120) -> int:
    """Poll metrics.jsonl until the run has logged ``step``; return the newest logged step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logged = records(output_dir)
        if logged and max(logged) >= step:
            return max(logged)
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout is not None else "(see its log)"
            pytest.fail(f"the run ended (status {process.returncode}) before step {step}:\n{output}")
        time.sleep(0.05)
    pytest.fail(f"no step {step} within {timeout} s")


def rank_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The training ranks under a deepspeed launcher (their command lines carry --local_rank)."""
    children = psutil.Process(launcher.pid).children(recursive=True)
    return sorted((p for p in children if any(a.startswith("--local_rank") for a in p.cmdline())),
                  key=lambda p: next(a for a in p.cmdline() if a.startswith("--local_rank")))
