"""Which launcher started a rank (txl_dist.rendezvous.launch_env): the variables of torchrun/deepspeed, srun, mpirun and
a plain process, read into one world; `.deepspeed_env` for pdsh, mpirun and srun (read back by DeepSpeed's own
runner code, and by a real bash for pdsh's command) and hostfiles as DeepSpeed's runner needs them. The launches
themselves run for real in tests/cluster/ and tests/test_liveness.py; bad launch environments are in
tests/bad_input/test_launch.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher import REPO
from txl_dist.rendezvous import launch_env, launch_formats
from txl_dist.rendezvous.launch_env import LaunchError, expand_hostlist, resolve


def test_slurm_host_lists_expand_in_order():
    assert expand_hostlist("txlnode1") == ["txlnode1"]
    assert expand_hostlist("node[01-03,7],gpu-a[1-2]-ib,solo") == [
        "node01",
        "node02",
        "node03",
        "node7",
        "gpu-a1-ib",
        "gpu-a2-ib",
        "solo",
    ]
    assert expand_hostlist("a[1-2]b[3-4]") == ["a1b3", "a1b4", "a2b3", "a2b4"]
    with pytest.raises(LaunchError, match="node\\[3-1\\]"):
        expand_hostlist("node[3-1]")


# What srun gives the second task of a 2-node step (one task per node), as Slurm 22.05 sets it.
SRUN_TASK_1 = {
    "SLURM_JOB_ID": "57",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_NODELIST": "txlnode[1-2]",
    "SLURM_JOB_NODELIST": "txlnode[1-2]",
}


def test_an_srun_task_is_a_rank_of_the_step_with_the_first_node_as_rendezvous():
    launch = resolve(SRUN_TASK_1)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (
        "slurm",
        1,
        2,
        0,
        1,
    )
    assert launch.master_addr == "txlnode1"
    # Every task of the step derives the same port without talking; another job gets another one.
    assert resolve({**SRUN_TASK_1, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}).master_port == launch.master_port
    assert resolve({**SRUN_TASK_1, "SLURM_JOB_ID": "58"}).master_port != launch.master_port
    # A user's MASTER_ADDR/MASTER_PORT win; 4 tasks on each of 3 nodes give the local world of this node.
    given = resolve({**SRUN_TASK_1, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "31000"})
    assert (given.master_addr, given.master_port) == ("10.0.0.9", 31000)
    assert (
        resolve(
            {
                **SRUN_TASK_1,
                "SLURM_STEP_TASKS_PER_NODE": "4(x2),2",
                "SLURM_STEP_NODELIST": "txlnode[1-3]",
                "SLURM_NODEID": "2",
                "SLURM_STEP_NUM_TASKS": "10",
                "SLURM_PROCID": "9",
                "SLURM_LOCALID": "1",
            }
        ).local_world_size
        == 2
    )


def test_the_batch_script_itself_is_not_a_rank_of_its_allocation():
    batch = {key: value for key, value in SRUN_TASK_1.items() if not key.startswith("SLURM_STEP")}
    batch.update(SLURM_PROCID="0", SLURM_NODEID="0")
    for step_id in (None, "4294967294"):  # no step id, or the batch step's own
        environ = dict(batch) if step_id is None else {**batch, "SLURM_STEP_ID": step_id}
        assert resolve(environ).launcher == "single"
        assert launch_env.single_task_in_multi_task_allocation(environ) == 2


def test_the_run_names_the_program_that_started_it():
    """The name the run's environment report gives (`LaunchEnvironment.name`), read once from the variables: torch's
    variables tell torchrun and DeepSpeed's per-node launcher apart by their own ones."""
    torch_world = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert resolve({**torch_world, "TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "1"}).name == "torchrun"
    assert resolve({**torch_world, "LOCAL_SIZE": "2", "CROSS_RANK": "0", "LOCAL_RANK": "1"}).name == "deepspeed"
    assert resolve(torch_world).name == "torch's variables (RANK, WORLD_SIZE)"
    assert resolve(SRUN_TASK_1).name == "slurm"
    assert resolve({}).name == "single"
    launched = launch_env.apply({**torch_world, "TORCHELASTIC_RUN_ID": "none"})
    assert launched.name == "torchrun"  # a world of one's free port or not, apply keeps what resolve found


def test_torch_variables_win_over_the_allocation_they_run_in():
    """deepspeed or torchrun started inside an sbatch script (or by mpirun) set torch's variables for their own
    ranks: those count, not SLURM_PROCID/OMPI_* of the process that started the launcher."""
    environ = {
        **SRUN_TASK_1,
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "3",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }
    launch = resolve(environ)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("torch", 5, 8, 1)
    with pytest.raises(LaunchError, match="MASTER_PORT"):
        resolve({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


def test_open_mpi_ranks_meet_at_the_host_of_mpirun_or_at_the_given_address():
    environ = {
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "OMPI_MCA_orte_hnp_uri": "401932288.0;tcp://10.231.87.11,172.17.0.1:41011",
    }
    launch = resolve({**SRUN_TASK_1, **environ})  # mpirun inside an allocation: MPI's numbering counts
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_addr) == ("openmpi", 1, 2, "10.231.87.11")
    # Rank 0 elsewhere than mpirun: the others would look for it in the wrong place.
    with pytest.raises(LaunchError, match="rank 0 of this mpirun runs on .* not on the host of mpirun"):
        resolve({**environ, "OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_hnp_uri": "1.0;tcp://192.0.2.77:41011"})
    local = resolve({**environ, "OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_orte_hnp_uri": "1.0;tcp://127.0.0.1:41011"})
    assert local.rank == 0 and local.master_addr == "127.0.0.1"
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        resolve({"PMI_SIZE": "2", "PMI_RANK": "0"})
    assert resolve({"PMI_SIZE": "2", "PMI_RANK": "1", "MASTER_ADDR": "h"}).launcher == "mpich"


def test_apply_keeps_what_a_launcher_set_and_refuses_a_rank_outside_its_world():
    environ = {**SRUN_TASK_1}
    launch_env.apply(environ)
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["MASTER_ADDR"]) == ("1", "2", "txlnode1")
    with pytest.raises(LaunchError, match="rank 2 in a world of 2"):
        launch_env.apply({**SRUN_TASK_1, "SLURM_PROCID": "2"})
    with pytest.raises(LaunchError, match="SLURM_PROCID='x'"):
        launch_env.apply({**SRUN_TASK_1, "SLURM_PROCID": "x"})
    single = {}
    launch_env.apply(single)
    assert single["WORLD_SIZE"] == "1" and single["MASTER_ADDR"] == "127.0.0.1"


def test_deepspeed_env_gets_the_run_variables_and_keeps_other_lines(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("NCCL_IB_HCA=mlx5\nOMP_NUM_THREADS=8\n")
    keys = launch_env.write_deepspeed_env(
        str(path),
        {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": "/v/ext", "MY_VAR": "x"},
        ("MY_VAR",),
    )
    assert keys == ["DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "MY_VAR"]
    assert path.read_text().splitlines() == [
        "NCCL_IB_HCA=mlx5",
        "DS_ACCELERATOR=cpu",
        "OMP_NUM_THREADS=1",
        "TORCH_EXTENSIONS_DIR=/v/ext",
        "MY_VAR=x",
    ]
    with pytest.raises(LaunchError, match="OMP_NUM_THREADS holds a line break"):
        launch_env.write_deepspeed_env(str(path), {"OMP_NUM_THREADS": "1\n2"})


PYTHON = sys.executable


def run_launch_env(*args: str, **environ: str) -> subprocess.CompletedProcess:
    """``python -m txl_dist.rendezvous.launch_env`` in an environment of its own (no variable of this session's
    launcher)."""
    base = {key: os.environ[key] for key in ("PATH", "HOME", "LANG") if key in os.environ}
    return subprocess.run(
        [PYTHON, "-m", "txl_dist.rendezvous.launch_env", *args],
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )


CARRIED = {
    "TXL_QUOTES": 'say "hi", it\'s',
    "TXL_DOLLAR": "$HOME and ${PATH} and $(id)",
    "TXL_BACKTICK": "`id -u`",
    "TXL_BACKSLASH": "C:\\dir\\new \\$x",
    "TXL_SPACES": "two  spaces",
    "TXL_PERCENT": "%h %n %u %% 100%",
    "TXL_PERCENT_ALONE": "50%h",
    "TXL_SHELL": "a;b|c&d>e<f*g?h[i]~j#k!l(m){n}",
    "TXL_TAB": "a\tb",
    "TXL_UNICODE": "naïve café ✓",
    "TXL_PLAIN": "k=v,w:x/y@z+1-2.3",
}
DUMP = (
    "import json, os, sys\n"
    "json.dump({k: v for k, v in os.environ.items() if k.startswith('TXL_')}, open(sys.argv[1], 'w'))\n"
)


def _deepspeed_reads(path: Path, runner) -> None:
    """``.deepspeed_env`` given to a runner as deepspeed/launcher/runner.py's main does (its loop, line for line)."""
    with open(path) as fd:
        for var in fd.readlines():
            key, val = var.split("=", maxsplit=1)
            runner.add_export(key, val)


def _runner(launcher: str):
    from deepspeed.launcher import multinode_runner
    from deepspeed.launcher.runner import encode_world_info, parse_args

    args = parse_args(["--launcher", launcher, "--hostfile", "/nonexistent", "dump.py", "out.json"])
    world_info = encode_world_info({"localhost": [0]})
    if launcher == "pdsh":
        return multinode_runner.PDSHRunner(args, world_info)
    classes = {"openmpi": multinode_runner.OpenMPIRunner, "slurm": multinode_runner.SlurmRunner}
    return classes[launcher](args, world_info, {"localhost": 1})


def _pdsh_expands(command: str, host: str, user: str, rank: int) -> str:
    """What pdsh's pipecmd does to the command before ssh sends it: %h, %u, %n and %% expanded, other % kept."""
    return re.sub(
        r"%(.)", lambda m: {"h": host, "u": user, "n": str(rank), "%": "%"}.get(m.group(1), m.group(0)), command
    )


def test_deepspeed_env_values_reach_the_ranks_of_deepspeeds_pdsh_launch_unchanged(tmp_path):
    """Quotes, $, backticks, backslashes, spaces, % and the shell's other characters: written by
    --write-deepspeed-env, read by DeepSpeed's own runner code into its pdsh command, expanded as pdsh does and run
    by a real bash (the remote shell): the rank's environment holds each value exactly."""
    path = tmp_path / ".deepspeed_env"
    launch_formats.write_deepspeed_env(str(path), CARRIED, tuple(CARRIED))
    runner = _runner("pdsh")
    _deepspeed_reads(path, runner)
    command, _, _ = runner.get_cmd({}, {"localhost": [0]})
    start = command.index("-w") + 2
    remote = " ".join(command[start : command.index(sys.executable)])  # the exports and the cd, as pdsh joins them
    dump, out = tmp_path / "dump.py", tmp_path / "out.json"
    dump.write_text(DUMP)
    shell = f"{_pdsh_expands(remote, 'node-001', 'someone', 0)} {PYTHON} {dump} {out}"
    subprocess.run(["bash", "--noprofile", "--norc", "-c", shell], env={"PATH": os.environ["PATH"]}, check=True)
    assert json.loads(out.read_text()) == CARRIED


@pytest.mark.parametrize("launcher", ["openmpi", "slurm"])
def test_deepspeed_env_for_mpirun_or_srun_carries_plain_values_and_refuses_the_rest(launcher, tmp_path):
    """mpirun -x K=V and srun --export=ALL,K=V get DeepSpeed's double quotes literally: values that would need
    them are refused in one line naming the variable; plain ones reach the command unchanged."""
    path = tmp_path / ".deepspeed_env"
    refused = set()
    for key, value in {**CARRIED, "OMP_NUM_THREADS": "4", "TXL_PATH": "/shared/v-2.1/ext@x+y:z"}.items():
        try:
            launch_formats.write_deepspeed_env(str(path), {key: value}, (key,), launcher=launcher)
        except LaunchError as error:
            assert re.match(rf"{key}=.*: DeepSpeed's {launcher} launcher cannot carry", str(error)), error
            refused.add(key)
            continue
        runner = _runner(launcher)
        _deepspeed_reads(path, runner)
        command = runner.get_cmd({}, {"localhost": [0]})
        if launcher == "openmpi":
            given = dict(command[i + 1].split("=", 1) for i, arg in enumerate(command) if arg == "-x")
        else:
            exports = next(arg for arg in command if arg.startswith("--export=ALL"))
            given = dict(item.split("=", 1) for item in exports.split(",")[1:])
        assert given[key] == value, (key, given)
    assert {"TXL_QUOTES", "TXL_DOLLAR", "TXL_SPACES", "TXL_BACKSLASH", "TXL_TAB"} <= refused
    assert "OMP_NUM_THREADS" not in refused and "TXL_PATH" not in refused and "TXL_PERCENT_ALONE" not in refused
    assert ("TXL_PLAIN" in refused) == (launcher == "slurm")  # srun's --export list splits at its comma


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1\n2", "OMP_NUM_THREADS holds a line break"),
        ("1\r2", "OMP_NUM_THREADS holds a line break"),
        (" 4", "OMP_NUM_THREADS=' 4' begins or ends with white space"),
        ("4\t", "begins or ends with white space"),
    ],
)
def test_deepspeed_env_refuses_values_no_launcher_can_carry_and_leaves_the_file(value, message, tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("NCCL_IB_HCA=mlx5\n")
    with pytest.raises(LaunchError, match=re.escape(message)):
        launch_formats.write_deepspeed_env(str(path), {"OMP_NUM_THREADS": value})
    assert path.read_text() == "NCCL_IB_HCA=mlx5\n" and os.listdir(tmp_path) == [".deepspeed_env"]


def test_deepspeed_env_drops_blank_and_comment_lines_with_a_warning_and_refuses_garbage(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("# my settings\nNCCL_IB_HCA=mlx5\n\nOMP_NUM_THREADS=8\n   \n")
    os.chmod(path, 0o600)
    result = run_launch_env("--write-deepspeed-env", "--path", str(path), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        rf".*warning: {re.escape(str(path))}: dropped line\(s\) 1, 3, 5 \(blank or comment\).*\n", result.stderr
    )
    assert path.read_text() == "NCCL_IB_HCA=mlx5\nDS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\n"
    assert os.stat(path).st_mode & 0o777 == 0o600  # a file that may hold secrets keeps its mode
    _deepspeed_reads(path, _runner("pdsh"))  # DeepSpeed's runner reads every line
    for garbage in ("garbage line without equals", "export FOO=bar", "MY-VAR=1", "=x"):
        path.write_text(f"NCCL_IB_HCA=mlx5\n{garbage}\n")
        result = run_launch_env("--write-deepspeed-env", "--path", str(path), OMP_NUM_THREADS="1")
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert f"{path}:2: {garbage!r} is not KEY=VALUE" in result.stderr
        assert path.read_text() == f"NCCL_IB_HCA=mlx5\n{garbage}\n"


def test_deepspeed_env_that_is_not_text_or_not_a_file_is_named_in_one_line(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_bytes(b"NCCL_IB_HCA=ml\xe9x5\n")
    for target, named in ((path, "not UTF-8 text (byte 14)"), (tmp_path, "a directory")):
        result = run_launch_env("--write-deepspeed-env", "--path", str(target), OMP_NUM_THREADS="1")
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert f"{target}: {named}" in result.stderr
    assert path.read_bytes() == b"NCCL_IB_HCA=ml\xe9x5\n"
    result = run_launch_env("--write-deepspeed-env", "--path", str(path), "--also", "MY-VAR", **{"MY-VAR": "1"})
    assert result.returncode == 2 and "'MY-VAR' is not a variable name" in result.stderr


def test_deepspeed_env_refuses_to_forward_a_variable_named_by_also_that_is_not_set(tmp_path):
    """A user who names a variable expects it on every rank: one unset (or empty) is refused, naming each such,
    and nothing is written; the ones that are set are forwarded when all are."""
    path = tmp_path / ".deepspeed_env"
    path.write_text("NCCL_IB_HCA=mlx5\n")
    also = ("--also", "FOOBAR", "MY_SET", "MY_EMPTY")
    result = run_launch_env("--write-deepspeed-env", "--path", str(path), *also, MY_SET="1", MY_EMPTY="")
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result
    assert "--also FOOBAR MY_EMPTY: not set here (or set empty), so there is nothing to forward" in result.stderr
    assert path.read_text() == "NCCL_IB_HCA=mlx5\n"
    result = run_launch_env("--write-deepspeed-env", "--path", str(path), *also, FOOBAR="x", MY_SET="1", MY_EMPTY="2")
    assert result.returncode == 0 and result.stdout == f"{path}: FOOBAR, MY_SET, MY_EMPTY\n", result
    assert path.read_text() == "NCCL_IB_HCA=mlx5\nFOOBAR=x\nMY_SET=1\nMY_EMPTY=2\n"
    # --also with no KEY after it named nothing and wrote the file as if it had not been given (audit, issue 38).
    result = run_launch_env("--write-deepspeed-env", "--path", str(path), "--also")
    assert result.returncode == 2 and result.stderr.splitlines()[-1].endswith(
        "error: --also names no variable: give the KEYs to forward, e.g. --also WANDB_API_KEY HF_HOME"
    ), result
    assert path.read_text() == "NCCL_IB_HCA=mlx5\nFOOBAR=x\nMY_SET=1\nMY_EMPTY=2\n"


@pytest.fixture
def immutable_folder(tmp_path):
    """A folder that refuses new files even to root (``chattr +i``); skipped where the file system has no such
    attribute."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_deepspeed_env_in_a_folder_that_refuses_writes_is_a_failure_of_the_surroundings(immutable_folder):
    """Not a refused input (2): the path is right, the surroundings refuse it (1), as the error policy says."""
    path = immutable_folder / ".deepspeed_env"
    result = run_launch_env("--write-deepspeed-env", "--path", str(path), OMP_NUM_THREADS="1")
    assert (result.returncode, result.stdout) == (1, ""), result
    assert result.stderr == f"txl_dist.rendezvous.launch_env: error: {path}: operation not permitted\n"
    assert os.listdir(immutable_folder) == []
    result = run_launch_env(
        "--write-deepspeed-env", "--path", str(immutable_folder / "nope" / "x"), OMP_NUM_THREADS="1"
    )
    assert result.returncode == 2 and "nope/x: no such file or directory" in result.stderr  # the path given is wrong


BAD_HOSTFILES = [
    ("node-001 slots=8\nnode-001 slots=8\n", ":2: node-001 is listed again (first on line 1)"),
    ("node-001 slots=two\n", ":1: 'node-001 slots=two' is not `HOST slots=N`"),
    ("node-001 slots=0\n", ":1: node-001 has slots=0: a host needs at least one slot"),
    ("node-001 slots=4x\n", ":1: 'node-001 slots=4x' is not"),
    ("node-001\n", ":1: 'node-001' is not"),
    ("node-001 slots=-1\n", ":1: 'node-001 slots=-1' is not"),
    ("node-001 slots=99999999999999999999\n", ":1: node-001 has slots=99999999999999999999: more ranks than a node"),
    ("node-001 slots=8\nnode-002 slots=1025\n", ":2: node-002 has slots=1025: more ranks than a node runs (1 to 1024)"),
    ("node-001 slots=8 max_slots=4\n", ":1: node-001 has max_slots=4: from its slots=8 to 1024"),
    ("node-001 slots=8 max_slots=99999999999\n", ":1: node-001 has max_slots=99999999999: from its slots=8 to 1024"),
    ("# no hosts\n\n", ": no host in the hostfile"),
    ("", ": no host in the hostfile"),
]


@pytest.mark.parametrize(("text", "message"), BAD_HOSTFILES)
def test_a_hostfile_deepspeeds_runner_mishandles_is_refused_naming_the_line(text, message, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(LaunchError) as refused:
        launch_formats.read_hostfile(str(hostfile))
    assert str(refused.value).startswith(f"{hostfile}{message}"), refused.value


def test_a_good_hostfile_reads_as_deepspeeds_runner_reads_it_and_the_command_line_checks_one(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-001 slots=8 max_slots=8\n\n  node-002   slots=4   # the small one\n")
    assert launch_formats.read_hostfile(str(hostfile)) == dict(fetch_hostfile(str(hostfile)))
    shipped = str(REPO / "launchers" / "hostfile.example")
    assert launch_formats.read_hostfile(shipped) == {"node-001": 8, "node-002": 8} == dict(fetch_hostfile(shipped))
    hostfile.write_text("node-001 slots=1024 max_slots=1024\nnode-002 slots=1\n")  # the bounds themselves
    assert launch_formats.read_hostfile(str(hostfile)) == {"node-001": 1024, "node-002": 1}
    hostfile.write_text("node-001 slots=8 max_slots=8\n\n  node-002   slots=4   # the small one\n")
    result = run_launch_env("--hostfile", str(hostfile))
    assert result.returncode == 0 and result.stdout == f"{hostfile}: 2 host(s), 12 rank(s) (node-001 8, node-002 4)\n"
    result = run_launch_env("--hostfile", str(hostfile), "--launcher", "openmpi")  # a flag of another action
    assert result.returncode == 2 and "--launcher applies to --write-deepspeed-env only" in result.stderr
    hostfile.write_text("node-001 slots=0\n")
    for target in (hostfile, tmp_path / "missing"):
        result = run_launch_env("--hostfile", str(target))
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and str(target) in result.stderr, result
    hostfile.write_bytes(b"n\xf6de slots=1\n")
    assert "not UTF-8 text (byte 1)" in run_launch_env("--hostfile", str(hostfile)).stderr
