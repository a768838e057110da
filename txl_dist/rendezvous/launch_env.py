"""Which launcher started this process, and the rank, world and rendezvous address it gave, in torch's terms.

Every way a cluster starts ranks is an entry: torchrun and DeepSpeed's per-node launcher set torch's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT``; ``srun`` (also under ``deepspeed --launcher
slurm``) sets ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` of the step; ``mpirun`` (also under ``deepspeed
--launcher openmpi``) sets ``OMPI_COMM_WORLD_*``; MPICH, Intel MPI and MVAPICH set ``PMI_RANK``/``PMI_SIZE`` or
``MV2_COMM_WORLD_*``. `resolve` reads whichever is there and checks that it makes one world, `apply` writes the torch
variables, so that ``env://`` forms one world of all the ranks. A process that cannot be placed in one world is
refused with one line that names the variable, before any store exists: never run as a world of one beside its
peers (each would train the whole job alone, on the same output directory), never left waiting for a rendezvous
that cannot happen.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import sys
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from txl_dist.exit_status import describe_error, exit_status, print_error, run_command
from txl_dist.rendezvous import launch_formats, slurm_env
from txl_dist.rendezvous.launch_formats import (  # noqa: F401 -- the run variables are named here for txl_dist.rendezvous.process_group
    COMPARED_VARIABLES,
    FORWARDED_BY_DEEPSPEED,
    RUN_VARIABLES,
    LaunchError,
    env_int,
    expand_hostlist,
)

DEFAULT_MASTER_PORT = 29500
RENDEZVOUS_TIMEOUT_VARIABLE = "TXL_RENDEZVOUS_TIMEOUT"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 180.0
"""How long a rank waits for the rendezvous (the store's connect and every rank's arrival): long enough for ranks
that srun or pdsh start some seconds apart, far below torch's 600 s, after which the rank says who it waited for."""
MAX_RENDEZVOUS_TIMEOUT_S = 1e6
"""The longest wait allowed (11.6 days): a longer one is a typing error."""
SINGLE_RANK_VARIABLE = "TXL_SINGLE_RANK"
"""Set to 1 to train as one process in the batch script of a Slurm allocation of several tasks (refused otherwise)."""
ADDRESS_RESOLVE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class LaunchEnvironment:
    launcher: str
    """What started the ranks: "torch" (torchrun, deepspeed's launcher), "slurm", "openmpi", "mpich", "mvapich",
    "single"."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    address_from: str = dataclasses.field(default="MASTER_ADDR", compare=False, repr=False)
    """Where master_addr came from (a variable's name), for the messages."""
    started_by: str = dataclasses.field(default="", compare=False, repr=False)
    """For torch's variables, the program that wrote them, as its own variables tell: "torchrun", "deepspeed"."""

    @property
    def name(self) -> str:
        """The launcher as a run's reports name it: torchrun, deepspeed, slurm, openmpi, ..., single (a process
        alone)."""
        if self.launcher == "torch":
            return self.started_by or "torch's variables (RANK, WORLD_SIZE)"
        return self.launcher

    def torch_variables(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _pair(environ: Mapping[str, str], first: str, second: str, launcher: str) -> bool:
    """Whether the pair of variables is there; LaunchError when only one of the two is (a world half given)."""
    present = [key for key in (first, second) if key in environ]
    if len(present) == 1:
        given, missing = present[0], second if present[0] == first else first
        raise LaunchError(
            f"{given}={environ[given]!r} is set but {missing} is not: {launcher} sets both for every rank; "
            f"unset {given} or start the ranks with their launcher"
        )
    return len(present) == 2


def _slurm(environ: Mapping[str, str]) -> LaunchEnvironment:
    world_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    if world_key not in environ:
        raise LaunchError("started by srun (SLURM_PROCID is set) but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is")
    world, rank = env_int(environ, world_key), env_int(environ, "SLURM_PROCID")
    slurm_env.step_port(environ)  # the job and step ids, read even where MASTER_PORT makes the port
    local_rank = env_int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    node_index = env_int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    if node_index < 0:
        raise LaunchError(f"the launcher set SLURM_NODEID={node_index}, a node id below 0")
    local_world, first_host = slurm_env.placement(environ, node_index)
    if local_world is None:
        if local_rank:
            raise LaunchError(
                f"SLURM_LOCALID={local_rank} is set but neither SLURM_STEP_TASKS_PER_NODE nor "
                "SLURM_TASKS_PER_NODE says how many tasks run on this node"
            )
        local_world = 1
    master, address_from = environ.get("MASTER_ADDR"), "MASTER_ADDR"
    if not master:
        if first_host is None:
            raise LaunchError(
                "started by srun, but neither MASTER_ADDR nor SLURM_STEP_NODELIST is set: "
                "export MASTER_ADDR=<the first node of the step>"
            )
        address_from = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
        master = first_host
    port = env_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else slurm_env.step_port(environ)
    return LaunchEnvironment("slurm", rank, world, local_rank, local_world, master, port, address_from)


def _hnp_address(environ: Mapping[str, str]) -> str | None:
    """The address of the host that runs ``mpirun`` (Open MPI's head node process, from its contact URI)."""
    for key in ("OMPI_MCA_orte_hnp_uri", "OMPI_MCA_prte_hnp_uri", "PMIX_SERVER_URI4", "PMIX_SERVER_URI3"):
        match = re.search(r"tcp://([0-9A-Za-z.-]+)[,:]", environ.get(key, ""))
        if match:
            return match.group(1)
    return None


def _is_local_address(address: str) -> bool:
    try:
        with socket.socket() as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


MPI_FAMILIES = (
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
)
"""Each MPI's (name, rank, size, local rank, local size) variables, in the order they are looked for."""


def _mpi(environ: Mapping[str, str], launcher: str, keys: tuple[str, str, str, str]) -> LaunchEnvironment:
    rank_key, size_key, local_rank_key, local_size_key = keys
    rank, world = env_int(environ, rank_key), env_int(environ, size_key)
    has_local = _pair(environ, local_rank_key, local_size_key, launcher)
    local_rank, local_world = (
        (env_int(environ, local_rank_key), env_int(environ, local_size_key)) if has_local else (0, 1)
    )
    master, address_from = environ.get("MASTER_ADDR"), "MASTER_ADDR"
    if not master and launcher == "openmpi":
        master, address_from = _hnp_address(environ), "OMPI_MCA_orte_hnp_uri"
        if master and rank == 0 and not _is_local_address(master):
            raise LaunchError(
                f"rank 0 of this mpirun runs on {socket.gethostname()}, not on the host of mpirun "
                f"({master}), where the other ranks look for it: start mpirun on the first host of the "
                "hostfile, or pass MASTER_ADDR=<rank 0's host> (mpirun -x, or .deepspeed_env)"
            )
    if not master:
        raise LaunchError(
            f"started by {launcher}'s mpirun without MASTER_ADDR: pass the first host of the hostfile, "
            "e.g. `mpirun -x MASTER_ADDR=<host> ...` or a line MASTER_ADDR=<host> in .deepspeed_env"
        )
    port = env_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else DEFAULT_MASTER_PORT
    return LaunchEnvironment(launcher, rank, world, local_rank, local_world, master, port, address_from)


def _torch(environ: Mapping[str, str]) -> LaunchEnvironment:
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(key):
            raise LaunchError(
                f"RANK and WORLD_SIZE are set but {key} is not: start the ranks with torchrun or deepspeed, or set it"
            )
    local_rank = env_int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
    # DeepSpeed's per-node launcher does not set LOCAL_WORLD_SIZE.
    local_world = env_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else local_rank + 1
    rank, world = env_int(environ, "RANK"), env_int(environ, "WORLD_SIZE")
    started_by = ""
    if "TORCHELASTIC_RUN_ID" in environ:
        started_by = "torchrun"
    elif "LOCAL_SIZE" in environ and "CROSS_RANK" in environ:  # DeepSpeed's per-node launcher
        started_by = "deepspeed"
    master_addr, master_port = environ["MASTER_ADDR"], env_int(environ, "MASTER_PORT")
    return LaunchEnvironment(
        "torch", rank, world, local_rank, local_world, master_addr, master_port, started_by=started_by
    )


def _single(environ: Mapping[str, str]) -> LaunchEnvironment:
    """A process alone: LOCAL_RANK/LOCAL_WORLD_SIZE without RANK and WORLD_SIZE describe no world of one."""
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if key in environ and env_int(environ, key) != (0 if key == "LOCAL_RANK" else 1):
            raise LaunchError(
                f"{key}={environ[key]!r} is set but RANK and WORLD_SIZE are not: a process alone is local rank 0 "
                "of 1; start the ranks with torchrun or deepspeed, or unset it"
            )
    port = env_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else 0  # 0: `apply` picks a free port
    return LaunchEnvironment("single", 0, 1, 0, 1, environ.get("MASTER_ADDR") or "127.0.0.1", port)


def _launcher_launch(environ: Mapping[str, str]) -> tuple[LaunchEnvironment, tuple[str, str, str, str]] | None:
    """An MPI's or a Slurm step's launch, with the names of its rank, world, local rank and local world variables;
    None where neither started this process."""
    in_step = slurm_env.in_step(environ)
    for launcher, *keys in MPI_FAMILIES:
        # Slurm's own PMI plugins set PMI_RANK in a step; the step's variables then say the rest.
        if launcher == "mpich" and in_step and "PMI_SIZE" not in environ:
            continue
        if _pair(environ, keys[0], keys[1], f"{launcher}'s mpirun"):
            return _mpi(environ, launcher, tuple(keys)), tuple(keys)
    if in_step:
        world_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
        per_node = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ else "SLURM_TASKS_PER_NODE"
        return _slurm(environ), ("SLURM_PROCID", world_key, "SLURM_LOCALID", per_node)
    return None


def _launch(environ: Mapping[str, str]) -> tuple[LaunchEnvironment, tuple[str, str, str, str]]:
    """The launch, and the names of the variables its rank, world, local rank and local world came from."""
    torch_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    lone = [key for key in ("RANK", "WORLD_SIZE") if key in environ]
    if len(lone) == 2:
        return _torch(environ), torch_keys
    found = _launcher_launch(environ)
    if found is None:
        _pair(environ, "RANK", "WORLD_SIZE", "torchrun or deepspeed")
        return _single(environ), torch_keys
    if lone:
        # DeepSpeed's mpich and impi launchers export WORLD_SIZE beside the MPI's own variables: it must agree.
        launch, keys = found
        key, own = lone[0], keys[0] if lone[0] == "RANK" else keys[1]
        if env_int(environ, key) != (launch.rank if key == "RANK" else launch.world_size):
            raise LaunchError(f"{key}={environ[key]!r} disagrees with {own}={environ[own]!r} of {launch.launcher}")
    return found


def _shown(environ: Mapping[str, str], *keys: str) -> str:
    given = [f"{key}={environ[key]!r}" for key in keys if key in environ]
    return f" ({', '.join(given)})" if given else ""


def _check(launch: LaunchEnvironment, environ: Mapping[str, str], keys: tuple[str, str, str, str]) -> None:
    """LaunchError, naming the variables, for a world that cannot exist or a rendezvous that cannot happen."""
    rank_key, world_key, local_rank_key, local_world_key = keys
    name = launch.launcher
    if launch.world_size < 1:
        raise LaunchError(
            f"{name} gave a world of {launch.world_size}{_shown(environ, world_key)}: a world has at least one rank"
        )
    if not 0 <= launch.rank < launch.world_size:
        raise LaunchError(
            f"{name} gave rank {launch.rank} in a world of {launch.world_size}{_shown(environ, rank_key, world_key)}:"
            f" ranks run from 0 to {launch.world_size - 1}"
        )
    if not 0 <= launch.local_rank < launch.local_world_size or launch.local_world_size > launch.world_size:
        raise LaunchError(
            f"{name} gave local rank {launch.local_rank} of {launch.local_world_size} on this node in a world of "
            f"{launch.world_size}{_shown(environ, local_rank_key, local_world_key, world_key)}: a local rank runs "
            f"from 0 to one below the node's rank count, which is 1 to the world's {launch.world_size}"
        )
    if not 0 <= launch.master_port <= 65535:
        raise LaunchError(
            f"MASTER_PORT={launch.master_port} is not a TCP port (1 to 65535; 0 in a world of one picks a free one)"
        )
    if launch.master_port == 0 and launch.world_size > 1:
        raise LaunchError(
            f"MASTER_PORT=0 in a world of {launch.world_size}: each rank would pick a port of its own and never "
            "meet; give every rank the same free port"
        )
    rendezvous_timeout_s(environ)


def resolve(environ: Mapping[str, str]) -> LaunchEnvironment:
    """The launch this environment describes, checked (LaunchError naming the variable otherwise). torch's
    variables win (torchrun or DeepSpeed's launcher started inside a Slurm job or an MPI launch sets them for its
    own ranks), then MPI's, then a Slurm step's; half of any pair (RANK without WORLD_SIZE, PMI_RANK without
    PMI_SIZE) is refused."""
    launch, keys = _launch(environ)
    _check(launch, environ, keys)
    return launch


def apply(
    environ: MutableMapping[str, str] | None = None, launch: LaunchEnvironment | None = None
) -> LaunchEnvironment:
    """`resolve` (or ``launch``, resolved already from the same variables), then write torch's variables into
    ``environ`` (the process environment by default)."""
    environ = os.environ if environ is None else environ
    launch = resolve(environ) if launch is None else launch
    if launch.master_port == 0:  # a world of one: any free port on loopback
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            launch = dataclasses.replace(launch, master_port=probe.getsockname()[1])
    # The values are the launcher's own, read and checked: torch's env:// reads exactly what `resolve` checked.
    environ.update(launch.torch_variables())
    return launch


def require_resolvable_address(launch: LaunchEnvironment, timeout_s: float = ADDRESS_RESOLVE_TIMEOUT_S) -> None:
    """LaunchError, naming the variable the address came from, when the rendezvous host does not resolve (torch's
    store would retry it, with a warning a second, for its whole timeout); a resolver that does not answer within
    ``timeout_s`` is an error too."""
    outcome: list[BaseException | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(launch.master_addr, launch.master_port, type=socket.SOCK_STREAM)
            outcome.append(None)
        except (OSError, UnicodeError) as error:
            outcome.append(error)

    thread = threading.Thread(target=lookup, name="txl_dist-resolve-master", daemon=True)
    thread.start()
    thread.join(timeout_s)
    where = f"{launch.address_from}" + ("" if launch.address_from == "MASTER_ADDR" else " (its first host)")
    if not outcome:
        raise LaunchError(f"{where}: {launch.master_addr!r} did not resolve within {timeout_s:g} s")
    if outcome[0] is not None:
        reason = getattr(outcome[0], "strerror", None) or str(outcome[0])
        raise LaunchError(
            f"{where}={launch.master_addr!r} does not resolve ({reason}): the ranks could never meet there; "
            "give the host name or address of rank 0's node"
        )


def rendezvous_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a rank waits for the rendezvous: TXL_RENDEZVOUS_TIMEOUT, else the default."""
    environ = os.environ if environ is None else environ
    value = environ.get(RENDEZVOUS_TIMEOUT_VARIABLE, "")
    if not value:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < MAX_RENDEZVOUS_TIMEOUT_S:
        raise LaunchError(
            f"{RENDEZVOUS_TIMEOUT_VARIABLE}={value!r}: give the seconds a rank waits, a number above 0 and below "
            f"{MAX_RENDEZVOUS_TIMEOUT_S:,.0f} (default {DEFAULT_RENDEZVOUS_TIMEOUT_S:g})"
        )
    return seconds


def single_task_in_multi_task_allocation(environ: Mapping[str, str]) -> int | None:
    """The task count of a Slurm allocation in whose batch script (or salloc shell: not a step) this process runs
    alone, started by no launcher, when the allocation has more than one task; else None."""
    if "SLURM_JOB_ID" not in environ or slurm_env.in_step(environ) or _launch(environ)[0].launcher != "single":
        return None
    env_int(environ, "SLURM_JOB_ID")
    tasks = slurm_env.allocation_tasks(environ)
    return tasks if tasks > 1 else None


def refuse_lone_batch_process(environ: Mapping[str, str], command: str = "python launchers/train.py ...") -> None:
    """LaunchError for a process started alone in the batch script of an allocation of several tasks, unless
    TXL_SINGLE_RANK=1 says that one process is meant: training there uses one task of the allocation."""
    tasks = single_task_in_multi_task_allocation(environ)
    if tasks and environ.get(SINGLE_RANK_VARIABLE) != "1":
        raise LaunchError(
            f"started alone in the batch script of Slurm job {environ['SLURM_JOB_ID']}, an allocation of {tasks} "
            f"tasks: start the ranks with `srun {command}` (or sbatch launchers/slurm.sbatch); to run one process "
            f"anyway, set {SINGLE_RANK_VARIABLE}=1"
        )


def write_deepspeed_env(path: str, environ: Mapping[str, str] | None = None, extra: tuple[str, ...] = (), **kwargs):
    """`txl_dist.rendezvous.launch_formats.write_deepspeed_env` (kept here, where the run's variables are named)."""
    return launch_formats.write_deepspeed_env(path, environ, extra, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """``python -m txl_dist.rendezvous.launch_env [--write-deepspeed-env [--launcher L] [--path P] [--also KEY ...]]
    [--hostfile H]``: show the launch this process sees (checked, with its rendezvous address resolved), write the
    run's variables into ``.deepspeed_env`` for the runner's launcher, or check a hostfile for DeepSpeed's runner."""
    parser = argparse.ArgumentParser(prog="python -m txl_dist.rendezvous.launch_env", description=main.__doc__)
    parser.add_argument(
        "--write-deepspeed-env",
        action="store_true",
        help=f"write {', '.join(RUN_VARIABLES)} (those set) into .deepspeed_env",
    )
    parser.add_argument(
        "--path",
        help="the file to write (default: ./.deepspeed_env, "
        "which deepspeed reads from the directory it is started in; ~/.deepspeed_env works too)",
    )
    parser.add_argument("--also", nargs="*", metavar="KEY", help="more variables to forward")
    parser.add_argument(
        "--launcher",
        choices=launch_formats.RUNNER_LAUNCHERS,
        help="the `deepspeed --launcher` that will read the file (default pdsh, the runner's): values are written "
        "so that it carries them unchanged, or refused",
    )
    parser.add_argument("--hostfile", metavar="H", help="check a hostfile as `deepspeed --hostfile H` reads it")
    args = parser.parse_args(argv)
    writing_only = [flag for flag in ("path", "also", "launcher") if getattr(args, flag) is not None]
    if args.hostfile and args.write_deepspeed_env:
        parser.error("--hostfile checks a hostfile and --write-deepspeed-env writes .deepspeed_env: give one")
    if writing_only and not args.write_deepspeed_env:
        parser.error(f"--{writing_only[0]} applies to --write-deepspeed-env only")
    if args.also == []:
        parser.error("--also names no variable: give the KEYs to forward, e.g. --also WANDB_API_KEY HF_HOME")
    try:
        if args.hostfile:
            hosts = launch_formats.read_hostfile(args.hostfile)
            slots = ", ".join(f"{host} {count}" for host, count in hosts.items())
            print(f"{args.hostfile}: {len(hosts)} host(s), {sum(hosts.values())} rank(s) ({slots})")
        elif args.write_deepspeed_env:
            path, also, launcher = args.path or ".deepspeed_env", tuple(args.also or ()), args.launcher or "pdsh"
            keys = launch_formats.write_deepspeed_env(path, extra=also, launcher=launcher)
            print(f"{path}: {', '.join(keys) if keys else 'nothing set to forward'}")
        else:
            launch = resolve(os.environ)
            require_resolvable_address(launch)
            print(launch)
    except (LaunchError, OSError) as error:
        print_error("txl_dist.rendezvous.launch_env", describe_error(error))
        return exit_status(error)  # 2 for a refused input; 1 for an OSError of the surroundings (no space, ...)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "txl_dist.rendezvous.launch_env"))
