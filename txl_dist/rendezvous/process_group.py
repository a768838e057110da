"""Forming the world of ranks: the launcher's variables, DeepSpeed's op cache, one rendezvous, one environment.

`start` is what every rank does before its first collective:

1. `txl_dist.rendezvous.launch_env.apply`: rank, world and rendezvous address from whichever launcher started
   the process (torchrun, DeepSpeed, srun, mpirun), or one line saying why this process cannot join one world.
2. `prepare_extension_cache`: DeepSpeed's shared-memory op (used for CPU all-reduces) is compiled at first use by
   torch's JIT loader. The cache is made per virtual environment and built with the environment's own ``ninja``,
   so a node whose PATH differs does not compile again; builds are serialised by a lock that the kernel releases
   when its holder dies, so the lock file left by a build that was killed is recognised as stale and removed
   (torch's own lock would make every later launch wait for it forever, printing nothing).
3. The rendezvous store (``env://``), within ``TXL_RENDEZVOUS_TIMEOUT`` seconds (180 by default: a rank that
   cannot reach it, or a rank 0 whose peers never come, says so in one line naming the address and the rank), then
   every rank's environment compared through it before the process group is made: ranks that disagree on the
   accelerator, the threads or the op cache stop with one message that names the variable and the ranks (a remote
   rank that never got the user's variables is the usual cause: ``deepspeed --hostfile`` forwards only a few
   variable families and ``.deepspeed_env``).
4. The process group, on that store, and DeepSpeed's communication wrapper around it.
5. `release_shm_buffer`: on the CPU, DeepSpeed's wrapper creates one shared-memory all-reduce buffer per rank
   (``/dev/shm/deepspeed_allreduce_buffer_{uid}_{address}_{port}_{rank}``, 66 MiB) and maps every other rank's;
   once every rank has mapped them all, each removes the name of its own. The mappings live on to the process's
   end, and no exit, however abrupt, leaves a buffer behind in the node's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import deepspeed
import psutil
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from txl_dist import deepspeed_internals
from txl_dist.exit_status import ReportedByRankZero, run_command
from txl_dist.rendezvous import launch_env

log = logging.getLogger("txl_dist.training")

SHM_OP_NAME = deepspeed_internals.SHM_OP_NAME
SHM_BUFFER = deepspeed_internals.SHM_BUFFER
"""The name DeepSpeed's CPU op gives a rank's all-reduce buffer, from the rendezvous variables it reads
(MASTER_ADDR, MASTER_PORT)."""
ENVIRONMENT_KEY = "txl_dist/environment/{rank}"
STORE_TIMEOUT = datetime.timedelta(minutes=10)


def venv_bin() -> Path:
    return Path(sys.executable).parent


def prepare_extension_cache(environ: dict[str, str] | None = None) -> Path:
    """Point torch's extension cache at this environment (unless the user chose one) and put the environment's
    own tools first on PATH; return the cache directory."""
    environ = os.environ if environ is None else environ
    if not environ.get("TORCH_EXTENSIONS_DIR"):
        # One folder per Python, accelerator build and torch release: a torch reinstalled in the environment
        # (a CUDA build over the CPU one) never loads an op compiled against the other.
        accelerator = (
            ("cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}")
            if getattr(torch.version, "hip", None) is None
            else f"rocm{torch.version.hip.replace('.', '')}"
        )
        python = f"py{sys.version_info.major}{sys.version_info.minor}"
        folder = f"{python}_{accelerator}_torch{torch.__version__.split('+')[0]}"
        environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions" / folder)
    tools = str(venv_bin())
    path = environ.get("PATH", "")
    if (venv_bin() / "ninja").exists() and path.split(os.pathsep)[:1] != [tools]:
        environ["PATH"] = tools + (os.pathsep + path if path else "")
    return Path(environ["TORCH_EXTENSIONS_DIR"])


def _build_directory(cache: Path, name: str) -> Path:
    """Where torch's JIT loader builds ``name`` when TORCH_EXTENSIONS_DIR is ``cache`` (as it always is here)."""
    return cache / name


@contextmanager
def build_lock(cache: Path, name: str = SHM_OP_NAME) -> Iterator[None]:
    """Hold the build of ``name`` in ``cache``; a torch lock file found while holding it was left by a killed
    build (every build of ours runs under this lock) and is removed, with a warning."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{name}.txl_dist-build-lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = _build_directory(cache, name) / "lock"
            if stale.exists():
                log.warning(
                    "removing %s, left by a build of DeepSpeed's %s op that was killed (it would make this "
                    "launch wait forever)",
                    stale,
                    name,
                )
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_shm_op() -> object | None:
    """DeepSpeed's shared-memory op for the CPU accelerator, built (once per cache) under `build_lock`; None where
    the accelerator has none. DeepSpeed's own start-up then finds it loaded."""
    if get_accelerator().device_name() != "cpu":
        return None

    # The seam keeps DeepSpeed's "built successfully" of this load quiet; its own start-up loads the op again and
    # says so once.
    with build_lock(prepare_extension_cache()):
        return deepspeed_internals.build_shm_op()


def environment_record() -> dict[str, object]:
    """What this rank runs with: the run-wide variables, the accelerator it picked, the library versions."""
    return {
        "variables": {key: os.environ.get(key) for key in launch_env.COMPARED_VARIABLES},
        "accelerator": get_accelerator().device_name(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def environment_disagreement(records: list[dict]) -> str | None:
    """One line naming the first difference between the ranks' records, or None when they agree."""

    def value(record: dict, key: str):
        return record["variables"].get(key) if key in launch_env.COMPARED_VARIABLES else record[key]

    first = records[0]
    for key in ("accelerator", *launch_env.COMPARED_VARIABLES, "torch", "deepspeed"):
        differing = [r for r, record in enumerate(records) if value(record, key) != value(first, key)]
        if differing:
            other = records[differing[0]]

            def shown(v):
                return "unset" if v is None else repr(v)

            more = f" (and {len(differing) - 1} more ranks)" if len(differing) > 1 else ""
            advice = (
                "set it for every rank: with `deepspeed --hostfile`, in .deepspeed_env "
                "(python -m txl_dist.rendezvous.launch_env --write-deepspeed-env)"
                if key in launch_env.COMPARED_VARIABLES
                else "install the same software on every node"
            )
            return (
                f"the ranks disagree on {key}: {shown(value(first, key))} on rank 0 ({first['host']}) but "
                f"{shown(value(other, key))} on rank {differing[0]} ({other['host']}){more}; {advice}"
            )
    return None


def _wait_for_listener(launch: launch_env.LaunchEnvironment, timeout_s: float) -> None:
    """Until rank 0's store accepts connections; LaunchError naming the address, the port and this rank when
    nothing does within ``timeout_s`` (torch's own client would retry for its timeout, printing a C++ stack trace
    at each try)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((launch.master_addr, launch.master_port), timeout=5):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise launch_env.LaunchError(
                    f"rank {launch.rank} of {launch.world_size} waited {timeout_s:g} s for the rendezvous at "
                    f"{launch.master_addr}:{launch.master_port} ({launch.address_from}, MASTER_PORT) and nothing "
                    f"answered ({error.strerror or error}): rank 0 has not started, or listens elsewhere, or a "
                    f"firewall blocks the port ({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE} sets the wait)"
                ) from None
            time.sleep(0.2)


def _rendezvous(launch: launch_env.LaunchEnvironment):
    """The store every rank meets at, made within TXL_RENDEZVOUS_TIMEOUT or one line saying why not."""
    timeout_s = launch_env.rendezvous_timeout_s()
    # Under torchrun every rank is a client of the agent's store; otherwise rank 0 serves it.
    client = launch.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if client:
        _wait_for_listener(launch, timeout_s)
    try:
        store, _, _ = next(
            dist.rendezvous("env://", launch.rank, launch.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        )
    except dist.DistError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        where = f"{launch.master_addr}:{launch.master_port}"
        if not client and isinstance(error, dist.DistNetworkError):  # the port is taken, or not this host's
            raise launch_env.LaunchError(
                f"rank 0 of {launch.world_size} cannot open the rendezvous at {where} (MASTER_PORT): {reason}"
            ) from None
        role = "for the other ranks" if not client else "for the store"
        raise launch_env.LaunchError(
            f"rank {launch.rank} of {launch.world_size} waited at most {timeout_s:g} s at {where} {role}: {reason} "
            f"({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE} sets the wait)"
        ) from None
    # Later store operations (heartbeats, the failure record) keep the long timeout they always had.
    store.set_timeout(STORE_TIMEOUT)
    return store


def agree_on_environment(store, rank: int, world_size: int) -> list[dict]:
    """Publish this rank's record and read everyone's; ValueError (the same on every rank) when they differ."""
    store.set(ENVIRONMENT_KEY.format(rank=rank), json.dumps(environment_record()))
    keys = [ENVIRONMENT_KEY.format(rank=r) for r in range(world_size)]
    # A rank that joined early waits here while rank 0 still waits (up to the timeout) for the last to join.
    timeout_s = 2 * launch_env.rendezvous_timeout_s()
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as error:  # torch raises a DistStoreError or a RuntimeError, by version
        missing = [str(r) for r, key in enumerate(keys) if not store.check([key])]
        raise launch_env.LaunchError(
            f"rank {rank}: rank(s) {', '.join(missing) or '?'} of {world_size} joined the store but did not "
            f"report their environment within {timeout_s:g} s ({type(error).__name__})"
        ) from None
    records = [json.loads(store.get(key)) for key in keys]
    problem = environment_disagreement(records)
    if problem:
        raise launch_env.LaunchError(problem) if rank == 0 else ReportedByRankZero(problem)
    return records


def start(device_type: str, launch: launch_env.LaunchEnvironment | None = None) -> tuple[int, int, list[dict]]:
    """Steps 2-4 of the module's docstring (`launch_env.apply` ran at process start: ``launch`` is what it returned,
    its address checked; None reads the launcher's variables here); returns (rank, world size, every rank's
    environment record)."""
    if launch is None:
        launch = launch_env.resolve(os.environ)
        launch_env.require_resolvable_address(launch)
    load_shm_op()
    if dist.is_initialized():
        records = [environment_record()]
    else:
        store = _rendezvous(launch)
        records = (
            agree_on_environment(store, launch.rank, launch.world_size)
            if launch.world_size > 1
            else [environment_record()]
        )
        dist.init_process_group(
            get_accelerator().communication_backend_name(),
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=deepspeed_internals.process_group_timeout(),
        )
    deepspeed.init_distributed()
    release_shm_buffer(dist.get_rank(), dist.get_world_size())
    # pdsh's ranks have only what .deepspeed_env (wherever DS_ENV_FILE put it) or a login shell gave them.
    forwarded = any(os.environ.get(key) for key in launch_env.RUN_VARIABLES if key != "TORCH_EXTENSIONS_DIR") or any(
        (Path(directory) / ".deepspeed_env").is_file() for directory in (os.path.expanduser("~"), os.getcwd())
    )
    if launch.rank == 0 and not forwarded and _started_over_ssh():
        log.warning(
            "started over ssh (deepspeed --hostfile) without a .deepspeed_env: the variables set where "
            "deepspeed was typed (%s) reached no rank unless a login shell sets them; write one with "
            "`python -m txl_dist.rendezvous.launch_env --write-deepspeed-env`",
            ", ".join(launch_env.RUN_VARIABLES[:3]),
        )
    return dist.get_rank(), dist.get_world_size(), records


def shm_buffer_path(rank: int, environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """Where DeepSpeed's CPU op keeps rank ``rank``'s all-reduce buffer in this launch."""
    address, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    return Path(SHM_BUFFER.format(uid=os.getuid(), address=address, port=port, rank=rank))


def release_shm_buffer(rank: int, world_size: int) -> None:
    """Collective: remove the name of this rank's shared-memory buffer once every rank has mapped every buffer
    (DeepSpeed's op maps the others' while the wrapper starts, before the barrier). A name that is not there (no
    shared-memory op: an accelerator, ranks on several nodes) is nothing to do."""
    if get_accelerator().device_name() != "cpu":
        return  # the op is the CPU accelerator's (the ranks agree on the accelerator: agree_on_environment)
    path = shm_buffer_path(rank)
    if world_size > 1:
        dist.barrier()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _started_over_ssh() -> bool:
    """Whether an sshd is among this process's ancestors (pdsh's way of starting DeepSpeed's launcher)."""
    try:
        return any(parent.name() == "sshd" for parent in psutil.Process().parents())
    except (psutil.Error, OSError):
        return False


def describe_environment(record: dict) -> str:
    """One line of a rank's record for the run's log."""
    variables = " ".join(f"{key}={value}" for key, value in record["variables"].items() if value is not None)
    return f"accelerator {record['accelerator']}, torch {record['torch']}, deepspeed {record['deepspeed']}, {variables}"


def main(argv: list[str] | None = None) -> int:
    """``python -m txl_dist.rendezvous.process_group``: build DeepSpeed's shared-memory op into this environment's cache
    (``make warm`` runs it, so that no launch compiles)."""
    parser = argparse.ArgumentParser(prog="python -m txl_dist.rendezvous.process_group", description=main.__doc__)
    parser.parse_args(argv)  # no flags: --help prints this, any other flag is refused before the build
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache = prepare_extension_cache()
    op = load_shm_op()
    print(
        f"DeepSpeed's {SHM_OP_NAME} op: {'ready' if op is not None else 'not used by this accelerator'} (cache {cache})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "txl_dist.rendezvous.process_group"))
