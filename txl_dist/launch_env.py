"""Which launcher started this process, and the rank, world and rendezvous address it gave, in torch's terms.

Every way a cluster starts ranks is an entry: torchrun and DeepSpeed's per-node launcher set torch's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT``; ``srun`` (also under ``deepspeed --launcher
slurm``) sets ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` of the step; ``mpirun`` (also under ``deepspeed
--launcher openmpi``) sets ``OMPI_COMM_WORLD_*``; MPICH, Intel MPI and MVAPICH set ``PMI_RANK``/``PMI_SIZE``.
`resolve` reads whichever is there and `apply` writes the torch variables, so that ``env://`` forms one world of
all the ranks. A process that cannot be placed in one world is refused with one line, never run as a world of one
beside its peers (each would train the whole job alone, on the same output directory).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500


class LaunchError(ValueError):
    """A launch whose ranks cannot form one world (printed as one line)."""


@dataclass(frozen=True)
class LaunchEnvironment:
    launcher: str
    """What started the ranks: "torch" (torchrun, deepspeed's launcher), "slurm", "openmpi", "mpich", "single"."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def torch_variables(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compact host list (``node[01-03,7],gpu-a[1-2]-ib``) as names, in order."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        names = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            expanded = []
            for item in ranges.split(",") if ranges else [""]:
                if "-" in item:
                    low, high = item.split("-", 1)
                    if not (low.isdigit() and high.isdigit()) or int(high) < int(low):
                        raise LaunchError(f"cannot read the Slurm host list {hostlist!r} (range {item!r})")
                    expanded += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
                else:
                    expanded.append(item)
            names = [name + literal + suffix for name in names for suffix in expanded]
        hosts += [name for name in names if name]
    return hosts


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ[key]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"the launcher set {key}={value!r}, which is not a whole number") from None


def _tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """This node's task count from Slurm's ``2(x3),1`` form."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise LaunchError(f"cannot read SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_index] if 0 <= node_index < len(counts) else counts[0]


def _slurm_port(environ: Mapping[str, str]) -> int:
    """A port all tasks of a step agree on without talking: derived from the job and step ids (two steps of one
    job, or two jobs on one node, get different ports unless their ids collide modulo 20,000)."""
    job = int(environ.get("SLURM_JOB_ID", "0") or 0)
    step = int(environ.get("SLURM_STEP_ID", "0") or 0) if environ.get("SLURM_STEP_ID", "").isdigit() else 0
    return 20000 + (job * 7 + step) % 20000


_SLURM_SPECIAL_STEPS = 0xFFFFFFF0
"""Step ids from here up are Slurm's own (the batch script is 0xFFFFFFFE, the extern step 0xFFFFFFFC)."""


def _in_slurm_step(environ: Mapping[str, str]) -> bool:
    """srun's tasks have a step id of their own; the batch script (also SLURM_PROCID=0) has none, or a special one."""
    step = environ.get("SLURM_STEP_ID", "")
    return "SLURM_PROCID" in environ and step.isdigit() and int(step) < _SLURM_SPECIAL_STEPS


def _slurm(environ: Mapping[str, str]) -> LaunchEnvironment:
    world = _int(environ, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS")
    rank = _int(environ, "SLURM_PROCID")
    local_rank = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node_index = int(environ.get("SLURM_NODEID", "0") or 0)
    local_world = _tasks_on_node(per_node, node_index) if per_node else 1
    master = environ.get("MASTER_ADDR")
    if not master:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise LaunchError(
                "started by srun, but neither MASTER_ADDR nor SLURM_STEP_NODELIST is set: "
                "export MASTER_ADDR=<the first node of the step>"
            )
        master = expand_hostlist(nodelist)[0]
    port = _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else _slurm_port(environ)
    return LaunchEnvironment("slurm", rank, world, local_rank, local_world, master, port)


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


def _mpi(
    environ: Mapping[str, str], launcher: str, rank_key: str, size_key: str, local_keys: tuple[str, str]
) -> LaunchEnvironment:
    rank, world = _int(environ, rank_key), _int(environ, size_key)
    local_rank = _int(environ, local_keys[0]) if local_keys[0] in environ else 0
    local_world = _int(environ, local_keys[1]) if local_keys[1] in environ else 1
    master = environ.get("MASTER_ADDR")
    if not master and launcher == "openmpi":
        master = _hnp_address(environ)
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
    port = _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else DEFAULT_MASTER_PORT
    return LaunchEnvironment(launcher, rank, world, local_rank, local_world, master, port)


def resolve(environ: Mapping[str, str]) -> LaunchEnvironment:
    """The launch this environment describes. torch's variables win (torchrun or DeepSpeed's launcher started
    inside a Slurm job or an MPI launch sets them for its own ranks), then MPI's, then a Slurm step's."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if not environ.get(key):
                raise LaunchError(
                    f"RANK and WORLD_SIZE are set but {key} is not: start the ranks with torchrun or "
                    "deepspeed, or set it"
                )
        local_rank = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
        # DeepSpeed's per-node launcher does not set LOCAL_WORLD_SIZE.
        local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else local_rank + 1
        return LaunchEnvironment(
            "torch",
            _int(environ, "RANK"),
            _int(environ, "WORLD_SIZE"),
            local_rank,
            local_world,
            environ["MASTER_ADDR"],
            _int(environ, "MASTER_PORT"),
        )
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return _mpi(
            environ,
            "openmpi",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    if "PMI_SIZE" in environ and "PMI_RANK" in environ:
        return _mpi(environ, "mpich", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))
    if "MV2_COMM_WORLD_SIZE" in environ:
        return _mpi(
            environ,
            "mvapich",
            "MV2_COMM_WORLD_RANK",
            "MV2_COMM_WORLD_SIZE",
            ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
        )
    if _in_slurm_step(environ):
        return _slurm(environ)
    return LaunchEnvironment("single", 0, 1, 0, 1, "127.0.0.1", 0)  # `apply` picks a free port


def apply(environ: MutableMapping[str, str] | None = None) -> LaunchEnvironment:
    """`resolve`, then write torch's variables into ``environ`` (the process environment by default) and check
    that the values make one world."""
    environ = os.environ if environ is None else environ
    launch = resolve(environ)
    if launch.master_port == 0:  # a world of one: any free port on loopback
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            launch = dataclasses.replace(launch, master_port=probe.getsockname()[1])
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
        raise LaunchError(f"{launch.launcher} gave rank {launch.rank} in a world of {launch.world_size}")
    if not 0 <= launch.local_rank < max(launch.local_world_size, 1):
        raise LaunchError(
            f"{launch.launcher} gave local rank {launch.local_rank} of {launch.local_world_size} on this node"
        )
    for key, value in launch.torch_variables().items():
        environ.setdefault(key, value)  # what a launcher set stays as it set it
    return launch


def single_task_in_multi_task_allocation(environ: Mapping[str, str]) -> int | None:
    """The task count of a Slurm allocation in whose batch script (not a step) this process runs alone, when the
    allocation has more than one task: the user most likely meant ``srun python launchers/train.py``."""
    if "SLURM_JOB_ID" in environ and not _in_slurm_step(environ) and "RANK" not in environ:
        try:
            tasks = int(environ.get("SLURM_NTASKS", "1"))
        except ValueError:
            return None
        return tasks if tasks > 1 else None
    return None


FORWARDED_BY_DEEPSPEED = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
"""Variable families that ``deepspeed --hostfile`` (pdsh over ssh) forwards to remote ranks by itself."""
COMPARED_VARIABLES = (
    "DS_ACCELERATOR",
    "OMP_NUM_THREADS",
    "TORCH_EXTENSIONS_DIR",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
)
"""The variables every rank of a run must agree on (accelerator, threads, op cache, network interfaces): the ranks
compare them at start-up (`txl_dist.training.world`)."""
RUN_VARIABLES = (*COMPARED_VARIABLES, "DEEPSPEED_TIMEOUT", "HF_HOME", "TMPDIR")
"""What a user sets for a run that must reach every rank (written into .deepspeed_env)."""


def write_deepspeed_env(path: str, environ: Mapping[str, str] | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """Write (or update) DeepSpeed's ``.deepspeed_env``: the run variables set here, one ``KEY=VALUE`` a line, so
    that ``deepspeed --hostfile`` exports them on every node. Lines for other keys are kept. Returns the keys."""
    environ = os.environ if environ is None else environ
    keys = [key for key in (*RUN_VARIABLES, *extra) if environ.get(key)]
    for key in keys:
        if "\n" in environ[key]:
            raise LaunchError(f"{key} holds a line break, which .deepspeed_env cannot carry")
    kept: list[str] = []
    try:
        with open(path, encoding="utf-8") as existing:
            kept = [line.rstrip("\n") for line in existing if line.strip() and line.split("=", 1)[0] not in keys]
    except FileNotFoundError:
        pass
    lines = kept + [f"{key}={environ[key]}" for key in keys]
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as out:
        out.write("".join(line + "\n" for line in lines))
    os.replace(temporary, path)
    return keys


def main(argv: list[str] | None = None) -> int:
    """``python -m txl_dist.launch_env [--write-deepspeed-env] [--path P] [--also KEY ...]``: show what launch this
    process sees, or write the run's variables into ``.deepspeed_env`` for ``deepspeed --hostfile``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m txl_dist.launch_env", description=main.__doc__)
    parser.add_argument(
        "--write-deepspeed-env",
        action="store_true",
        help=f"write {', '.join(RUN_VARIABLES)} (those set) into .deepspeed_env",
    )
    parser.add_argument(
        "--path",
        default=".deepspeed_env",
        help="the file to write (default: ./.deepspeed_env, "
        "which deepspeed reads from the directory it is started in; ~/.deepspeed_env works too)",
    )
    parser.add_argument("--also", nargs="*", default=[], metavar="KEY", help="more variables to forward")
    args = parser.parse_args(argv)
    try:
        if args.write_deepspeed_env:
            keys = write_deepspeed_env(args.path, extra=tuple(args.also))
            print(f"{args.path}: {', '.join(keys) if keys else 'nothing set to forward'}")
        else:
            print(resolve(os.environ))
    except (LaunchError, OSError) as error:
        print(f"txl_dist.launch_env: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
