"""Running the shipped launchers for real from tests: `deepspeed` (or torchrun) on 2 CPU ranks, a launcher's main in
this process, and reading what a run wrote."""

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

from txl_dist.config import load_config
from txl_dist.data import TrainStreams

REPO = Path(__file__).resolve().parents[1]


def _beside_interpreter(name: str) -> str:
    """The launcher installed beside this interpreter (a virtual environment), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or str(beside))


TRAIN = "launchers/train.py"
STEPS = 40
"""The length of the reference run (`tiny_args`, the ``reference`` fixture of tests/conftest.py)."""


def tiny_args(shards: Path, output_dir: Path, *extra: str) -> list[str]:
    """The tiny model, ZeRO 2 fp32, dropout on, a schedule fixed at 40 steps whatever train.max_steps says (a high
    learning rate so that the loss visibly falls within them). The validation pass at the end of a run scores PTB
    valid in 36 segments of 64 streams (tiny_cpu.yaml's 4 streams of 8 tokens would take 2,305 forwards)."""
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.shards={shards}",
        f"train.output_dir={output_dir}",
        "model.dropout=0.1",
        "optim.lr=5e-3",
        "schedule.warmup_steps=2",
        f"schedule.total_steps={STEPS}",
        "log.every=1",
        "eval.every=0",
        "eval.batch_size=64",
        "eval.tgt_len=32",
        "checkpoint.every=10",
        "checkpoint.keep_last=0",
        *extra,
    ]


REFERENCE_COMMAND: list[str] = []
"""The command of the reference run, for the buffers it may have left."""


DEEPSPEED = _beside_interpreter("deepspeed")
TORCHRUN = _beside_interpreter("torchrun")
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


def remove_shm_buffers(directory: Path = Path("/dev/shm")) -> list[Path]:
    """Remove the shared-memory buffers of the DeepSpeed runs this session started (named
    ``deepspeed_allreduce_buffer_{...}_{master address}_{master port}_{rank}``), and only those; return them."""
    removed = []
    for port in sorted(PORTS_USED):
        for path in directory.glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            path.unlink(missing_ok=True)
            removed.append(path)
    PORTS_USED.clear()
    return removed


def shm_buffers_left(command: list[str], directory: Path = Path("/dev/shm")) -> list[Path]:
    """The shared-memory all-reduce buffers of the run that ``command`` (a `launcher_command` or
    `torchrun_command`) started that are still in ``directory``: by its master port."""
    port = command[command.index("--master_port") + 1]
    return sorted(directory.glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def launcher_command(
    script: str, args: list[str], nprocs: int = 2, launcher_flags: list[str] | None = None
) -> list[str]:
    flags = (
        launcher_flags if launcher_flags is not None else ["--num_gpus", str(nprocs), "--master_port", str(free_port())]
    )
    return [DEEPSPEED, *flags, script, *args]


def torchrun_command(script: str, args: list[str], nprocs: int = 2) -> list[str]:
    """``nprocs`` ranks of ``script`` started by torchrun, which the trainer supports as well as DeepSpeed's
    launcher: for the tests whose subject is what the ranks do, not how they were started. The deepspeed runner
    starts DeepSpeed's per-node launcher, which starts the ranks, each of the three importing torch and DeepSpeed
    in turn; torchrun's agent imports torch alone. A 2-rank job that only imports them took 23-28 s under
    deepspeed and 8-11 s under torchrun on the test machine (2 cores, shared). The tests of the launcher chain
    itself (signals to the runner, kill -9, several nodes, one failure message) keep `launcher_command`."""
    return [
        TORCHRUN,
        "--nproc_per_node",
        str(nprocs),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        script,
        *args,
    ]


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **CPU_ENV, **(extra or {})}


def run(
    command: list[str], timeout: float = 300, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``command`` to its end, its output captured; ``env``: variables added to the environment."""
    result = subprocess.run(command, cwd=REPO, env=environment(env), capture_output=True, text=True, timeout=timeout)
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


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        command, cwd=REPO, env=environment(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> str:
    """The output of a job started by `start`, once it has ended. A job still running after ``timeout`` seconds
    (ranks that wait for each other forever: the failure some tests exist to catch) is killed, its ranks with it,
    so that the failing test leaves nothing running."""
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        tree = psutil.Process(process.pid)
        for member in [*tree.children(recursive=True), tree]:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
        output = process.communicate()[0] or ""
        pytest.fail(f"{' '.join(process.args)} still ran after {timeout} s (killed):\n{output[-3000:]}")


def tail(result, lines: int = 60) -> str:
    text = (result.stdout or "") + (result.stderr or "")
    return "\n".join(text.splitlines()[-lines:])


def copy_at_step(run_dir: Path, step: int, copy: Path) -> Path:
    """A copy of a finished run as it was after its checkpoint of ``step``: the later checkpoints and metrics
    lines gone, ``latest`` naming that checkpoint. What resuming from it must reproduce is the rest of the run."""
    shutil.copytree(run_dir, copy)
    checkpoints = copy / "checkpoints"
    for folder in checkpoints.iterdir():
        if folder.name.startswith("step") and int(folder.name.removeprefix("step")) > step:
            shutil.rmtree(folder)
    assert (checkpoints / f"step{step:08d}" / "COMPLETE.json").is_file(), f"{run_dir} has no checkpoint of step {step}"
    (checkpoints / "latest").write_text(f"step{step:08d}\n")
    metrics = copy / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step]
    metrics.write_text("".join(line + "\n" for line in kept))
    return copy


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
    """The training ranks under a deepspeed or torchrun launcher, by rank: the processes below it whose
    environment names their rank (DeepSpeed's per-node launcher, and torchrun's agent, have none)."""
    ranks = {}
    for process in psutil.Process(launcher.pid).children(recursive=True):
        rank = process.environ().get("RANK")
        if rank is not None and "LOCAL_RANK" in process.environ():
            ranks[int(rank)] = process
    return [ranks[rank] for rank in sorted(ranks)]


def run_streams(
    shards: Path,
    overrides: list[str],
    *,
    world_size: int = 1,
    rank: int = 0,
    config: str | Path = "configs/tiny_cpu.yaml",
) -> tuple[TrainStreams, int]:
    """The training streams rank ``rank`` of a run of ``config`` with ``overrides`` on ``world_size`` ranks reads
    (open them with ``with``), and the run's micro-batches per step."""
    cfg = load_config(config, [f"data.shards={shards}", *overrides])
    split = cfg.train.batch_split(world_size)
    streams = TrainStreams(
        shards,
        cfg.data.train_split,
        tgt_len=cfg.model.tgt_len,
        micro_batch=split.micro_batch,
        grad_accum=split.grad_accum,
        world_size=world_size,
        rank=rank,
        seed=cfg.train.seed,
        shuffle_blocks=cfg.data.shuffle_blocks,
    )
    return streams, split.grad_accum
