"""What a launch needs to start and keep going, on one host: a rank that stops making progress is named, ranks that
disagree on their environment stop before training, DeepSpeed's op compiles once per environment and a launch
after a build killed midway starts. (The same on a real two-node Slurm cluster: tests/cluster/.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launcher import (
    REPO,
    TORCHRUN,
    environment,
    finish,
    free_port,
    rank_processes,
    start,
    torchrun_command,
    wait_for_step,
)

pytestmark = pytest.mark.launcher

TRAIN = "launchers/train.py"


def _args(shards: Path, output: Path, *extra: str) -> list[str]:
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.shards={shards}",
        f"train.output_dir={output}",
        "train.max_steps=100000",
        "log.every=1",
        "eval.every=0",
        "checkpoint.every=10",
        *extra,
    ]


def _rank_tracebacks(out: str) -> list[str]:
    """Traceback lines from the ranks' code (txl_dist, the launchers, torch.distributed under them)."""
    return [
        line
        for line in out.splitlines()
        if line.strip().startswith('File "')
        and ("txl_dist/" in line or "launchers/train.py" in line or "distributed_c10d" in line)
    ]


def test_a_stopped_rank_is_named_within_the_stall_timeout_and_the_job_ends_non_zero(ptb_word_shards, tmp_path):
    output = tmp_path / "stalled"
    process = start(torchrun_command(TRAIN, _args(ptb_word_shards, output, "train.stall_timeout=6")))
    wait_for_step(output, 12, process)
    stopped = rank_processes(process)[1]
    stopped.send_signal(signal.SIGSTOP)  # a hung GPU or a dead NIC, as far as the other ranks can tell
    since = time.monotonic()
    try:
        # Once rank 0 has recorded the stall, the stopped rank is killed, as a hung host is once its job ends:
        # torchrun would otherwise wait its 30 s for the stopped process to act on SIGTERM, which it cannot.
        faults = output / "faults.jsonl"
        while time.monotonic() - since < 60 and not (faults.is_file() and faults.read_text().strip()):
            time.sleep(0.1)
        stopped.kill()
        out = finish(process, timeout=90)
    finally:
        if stopped.is_running():
            stopped.kill()
    took = time.monotonic() - since
    assert process.returncode != 0, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith(
        f"train.py: error: rank 1 ({os.uname().nodename}, PID {stopped.pid}) has made no progress for "
    ), errors
    assert "(train.stall_timeout=6), at step " in errors[0] and "since its last checkpoint (step" in errors[0]
    assert not _rank_tracebacks(out), out[-3000:]  # torchrun's agent prints its own ChildFailedError, not ours
    # Named after the stall timeout, well before gloo's own collective timeout (10 minutes).
    line_logged = [line for line in out.splitlines() if "has made no progress for" in line][0]
    stalled_for = int(line_logged.split("has made no progress for ")[1].split(" s")[0])
    assert 6 <= stalled_for <= 20 and took < 80, (stalled_for, took)
    # The same, as a record for what decides the next step (the Slurm batch script: txl_dist.supervision.faults).
    recorded = [json.loads(line) for line in (output / "faults.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"], r["host"], r["reporter"]) for r in recorded] == [
        ("stalled", 1, os.uname().nodename, 0)
    ], recorded
    assert recorded[0]["message"] == errors[0] and isinstance(recorded[0]["step"], int), recorded


def test_ranks_that_disagree_on_their_environment_stop_before_training(ptb_word_shards, tmp_path):
    """Two "nodes" of one rank each (torchrun's static rendezvous on loopback); the second was started without
    the user's OMP_NUM_THREADS, as a remote rank of `deepspeed --hostfile` is without .deepspeed_env."""
    port = free_port()
    output = tmp_path / "disagree"
    nodes = []
    for node_rank, threads in ((0, "1"), (1, "2")):
        env = {**environment(), "OMP_NUM_THREADS": threads}
        command = [
            TORCHRUN,
            "--nnodes",
            "2",
            "--node_rank",
            str(node_rank),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            TRAIN,
            *_args(ptb_word_shards, output),
        ]
        nodes.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [finish(node, timeout=120) for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outs
    both = "\n".join(outs)
    errors = [line for line in both.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1, both[-3000:]
    assert errors[0].startswith("train.py: error: the ranks disagree on OMP_NUM_THREADS: '1' on rank 0 "), errors
    assert "but '2' on rank 1" in errors[0] and ".deepspeed_env" in errors[0], errors
    assert not (output / "checkpoints").exists() or not any((output / "checkpoints").iterdir())
    assert not _rank_tracebacks(both), both[-3000:]


def _op_build_dir() -> Path:
    from txl_dist.rendezvous import process_group

    return process_group._build_directory(
        process_group.prepare_extension_cache(dict(os.environ)), process_group.SHM_OP_NAME
    )


_LOAD_OP = (
    "from txl_dist.rendezvous import process_group; "
    "print('loaded', process_group.load_shm_op() is not None, flush=True)"
)


def _load_op(env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-c", _LOAD_OP], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"loading DeepSpeed's op still waited after {timeout} s:\n{expired.stderr}")


def test_deepspeed_op_is_built_once_per_environment_whatever_the_path(tmp_path):
    """`make warm` built the op into this environment's cache; a launch with another PATH (a node's login shell,
    /usr/bin first) or no TORCH_EXTENSIONS_DIR of its own uses it as it is."""
    built = _op_build_dir() / f"{'deepspeed_shm_comm'}.so"
    if not built.is_file():
        assert _load_op({**environment()}).returncode == 0
    assert built.is_file(), f"no {built}: the op cache is not per environment"
    before = built.stat().st_mtime_ns
    env = {key: value for key, value in environment().items() if key != "TORCH_EXTENSIONS_DIR"}
    env["PATH"] = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])
    result = _load_op(env)
    assert result.returncode == 0 and "loaded True" in result.stdout, result.stderr[-3000:]
    assert built.stat().st_mtime_ns == before, "the op was compiled again"
    assert "Building extension" not in result.stderr and "ninja" not in result.stderr.lower(), result.stderr[-2000:]


def test_a_launch_after_a_build_killed_midway_does_not_wait_forever(tmp_path):
    """torch's JIT loader waits, printing nothing, for as long as the lock file of a build exists; a build killed
    midway (an OOM kill, scancel) leaves it behind for every later launch on the machine."""
    stale = _op_build_dir() / "lock"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("")
    try:
        result = _load_op({**environment()}, timeout=120)
    finally:
        stale.unlink(missing_ok=True)
    assert result.returncode == 0 and "loaded True" in result.stdout, result.stderr[-3000:]
    assert f"removing {stale}, left by a build of DeepSpeed's deepspeed_shm_comm op that was killed" in result.stderr


def test_a_build_in_progress_is_waited_for_not_removed(tmp_path):
    """The lock file of a build that is running (its builder holds our build lock) is not stale."""
    from txl_dist.rendezvous import process_group

    cache = process_group.prepare_extension_cache(dict(os.environ))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from txl_dist.rendezvous import process_group\n"
                f"cache = Path({str(cache)!r})\n"
                "with process_group.build_lock(cache):\n"
                "    lock = process_group._build_directory(cache, process_group.SHM_OP_NAME) / 'lock'\n"
                "    lock.write_text('')\n"
                "    print('holding', flush=True); time.sleep(4); lock.unlink()\n"
            ),
        ],
        cwd=REPO,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        started = time.monotonic()
        result = _load_op({**environment()}, timeout=120)
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
        (process_group._build_directory(cache, process_group.SHM_OP_NAME) / "lock").unlink(missing_ok=True)
    assert result.returncode == 0 and "loaded True" in result.stdout, result.stderr[-3000:]
    assert "removing" not in result.stderr and waited >= 2.0, (waited, result.stderr[-2000:])
