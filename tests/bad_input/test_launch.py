"""Bad launcher environments, as txl_dist.rendezvous reads them (launch_env, and process_group's rendezvous): each
refused in one line naming the variable, before any store exists, or read as given (hostfiles and .deepspeed_env
values: tests/test_launch_env.py); launchers/train.py in a Slurm batch script. The rendezvous that cannot happen is
started for real (a store, a rank with no peer) and must end within its timeout with one line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.launcher import REPO, free_port
from tests.test_launch_env import run_launch_env
from txl_dist.rendezvous import launch_env
from txl_dist.rendezvous.launch_env import LaunchError, expand_hostlist, resolve

PYTHON = sys.executable


TORCH = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


STEP = {  # the fourth task of an srun step of 8 tasks on 2 nodes, as Slurm sets it
    "SLURM_JOB_ID": "57",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_JOB_NODELIST": "node[01-02]",
}


OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h"}


MV2 = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "h"}


PMI = {"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h"}


def without(environ: dict[str, str], *keys: str) -> dict[str, str]:
    return {key: value for key, value in environ.items() if key not in keys}


# ---- launcher variables and host lists: refused in one line, or read as given ----------------------------------------


REFUSED = [
    # half of a pair: a world that each launcher gives whole
    ({"RANK": "1"}, r"RANK='1' is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "4"}, r"WORLD_SIZE='4' is set but RANK is not"),
    ({"WORLD_SIZE": "4", **TORCH}, r"WORLD_SIZE='4' is set but RANK is not"),
    ({**PMI, "WORLD_SIZE": "4"}, r"WORLD_SIZE='4' disagrees with PMI_SIZE='2' of mpich"),
    ({**STEP, "RANK": "0"}, r"RANK='0' disagrees with SLURM_PROCID='3' of slurm"),
    ({"LOCAL_RANK": "1"}, r"LOCAL_RANK='1' is set but RANK and WORLD_SIZE are not"),
    ({"LOCAL_WORLD_SIZE": "8"}, r"LOCAL_WORLD_SIZE='8' is set but RANK and WORLD_SIZE"),
    (without(OMPI, "OMPI_COMM_WORLD_RANK"), r"OMPI_COMM_WORLD_SIZE='2' is set but OMPI_COMM_WORLD_RANK is not"),
    (without(OMPI, "OMPI_COMM_WORLD_SIZE"), r"OMPI_COMM_WORLD_RANK='1' is set but OMPI_COMM_WORLD_SIZE is not"),
    (
        {**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
        r"OMPI_COMM_WORLD_LOCAL_RANK='1' is set but OMPI_COMM_WORLD_LOCAL_SI",
    ),
    (without(MV2, "MV2_COMM_WORLD_RANK"), r"MV2_COMM_WORLD_SIZE='2' is set but MV2_COMM_WORLD_RANK is not"),
    (without(MV2, "MV2_COMM_WORLD_SIZE"), r"MV2_COMM_WORLD_RANK='1' is set but MV2_COMM_WORLD_SIZE is not"),
    (without(PMI, "PMI_SIZE"), r"PMI_RANK='1' is set but PMI_SIZE is not"),
    (without(PMI, "PMI_RANK"), r"PMI_SIZE='2' is set but PMI_RANK is not"),
    # impossible worlds
    ({"RANK": "2", "WORLD_SIZE": "2", **TORCH}, r"rank 2 in a world of 2 \(RANK='2', WORLD_SIZE='2'\)"),
    ({"RANK": "-1", "WORLD_SIZE": "2", **TORCH}, r"rank -1 in a world of 2"),
    ({"RANK": "0", "WORLD_SIZE": "-2", **TORCH}, r"a world of -2 \(WORLD_SIZE='-2'\)"),
    ({"RANK": "0", "WORLD_SIZE": "0", **TORCH}, r"a world of 0 \(WORLD_SIZE='0'\)"),
    ({"RANK": "one", "WORLD_SIZE": "2", **TORCH}, r"RANK='one', which is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", **TORCH}, r"LOCAL_RANK='2'"),
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "2"}, r"rank 2 in a world of 2 \(OMPI_COMM_WORLD_RANK='2'"),
    ({**MV2, "MV2_COMM_WORLD_SIZE": "x"}, r"MV2_COMM_WORLD_SIZE='x', which is not a whole number"),
    ({**PMI, "PMI_SIZE": "-1"}, r"a world of -1 \(PMI_SIZE='-1'\)"),
    ({**STEP, "SLURM_PROCID": "8"}, r"rank 8 in a world of 8 \(SLURM_PROCID='8', SLURM_STEP_NUM_TASKS='8'\)"),
    ({**STEP, "SLURM_LOCALID": "4"}, r"local rank 4 of 4 .*SLURM_LOCALID='4'"),
    # ports
    ({"RANK": "1", "WORLD_SIZE": "2", **TORCH, "MASTER_PORT": "0"}, r"MASTER_PORT=0 in a world of 2"),
    ({"RANK": "1", "WORLD_SIZE": "2", **TORCH, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
    ({"RANK": "1", "WORLD_SIZE": "2", **TORCH, "MASTER_PORT": "http"}, r"MASTER_PORT='http', which is not a whole"),
    ({**STEP, "MASTER_PORT": "-5"}, r"MASTER_PORT=-5 is not a TCP port"),
    ({"MASTER_PORT": "99999"}, r"MASTER_PORT=99999 is not a TCP port"),
    # Slurm's ids and lists
    ({**STEP, "SLURM_JOB_ID": "abc"}, r"SLURM_JOB_ID='abc', which is not a whole number"),
    ({**STEP, "SLURM_JOB_ID": "abc", "MASTER_PORT": "29500"}, r"SLURM_JOB_ID='abc', which is not a whole number"),
    ({**STEP, "SLURM_NODEID": "x"}, r"SLURM_NODEID='x', which is not a whole number"),
    ({**STEP, "SLURM_NODEID": "-1"}, r"SLURM_NODEID=-1"),
    ({**STEP, "SLURM_STEP_ID": "first"}, r"SLURM_STEP_ID='first', which is not a whole number"),
    ({**STEP, "SLURM_NODEID": "5"}, r"SLURM_NODEID=5, but SLURM_STEP_TASKS_PER_NODE='4\(x2\)' lists 2 node"),
    ({**STEP, "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x3)"}, r"SLURM_NODEID=2, but SLURM_STEP_NODELIST"),
    ({**STEP, "SLURM_STEP_NODELIST": "node[01-03"}, r"SLURM_STEP_NODELIST='node\[01-03': a '\[' is never closed"),
    ({**STEP, "SLURM_STEP_NODELIST": "node[03-01]"}, r"SLURM_STEP_NODELIST='node\[03-01\]' \(range '03-01' runs"),
    ({**STEP, "SLURM_STEP_NODELIST": ""}, r"SLURM_STEP_NODELIST='': no host"),
    ({**STEP, "SLURM_STEP_NODELIST": "node[]"}, r"SLURM_STEP_NODELIST='node\[\]'"),
    ({**STEP, "SLURM_STEP_NODELIST": "node]1"}, r"SLURM_STEP_NODELIST='node\]1': a '\]' without its '\['"),
    ({**STEP, "SLURM_STEP_NODELIST": "a,,b"}, r"SLURM_STEP_NODELIST='a,,b': an empty name"),
    ({**STEP, "SLURM_STEP_NODELIST": "node 1,node2"}, r"SLURM_STEP_NODELIST='node 1,node2': an empty name, or white"),
    ({**STEP, "SLURM_STEP_NODELIST": "n[1-x]"}, r"SLURM_STEP_NODELIST='n\[1-x\]' \(range '1-x'"),
    ({**STEP, "SLURM_STEP_NODELIST": "n[1-999999999]"}, r"more than 100000 hosts"),
    # each bracket and each name under the limit, their product or their sum over it: counted before any is built
    (
        {**STEP, "SLURM_STEP_NODELIST": "a[00000-99998]b[00000-99998]"},
        r"it names 9,999,800,001 hosts, more than 100000",
    ),
    ({**STEP, "SLURM_STEP_NODELIST": "a[1-400]b[1-400]"}, r"it names 160,000 hosts, more than 100000"),
    ({**STEP, "SLURM_STEP_NODELIST": "x[0-9]" * 6}, r"it names 1,000,000 hosts"),
    ({**STEP, "SLURM_STEP_NODELIST": "a[1-60000],b[1-20000,30000-50000]"}, r"it names 100,001 hosts"),
    ({**without(STEP, "SLURM_STEP_NODELIST"), "SLURM_JOB_NODELIST": "a[0-9999]b[0-9999]"}, r"SLURM_JOB_NODELIST="),
    ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x)"}, r"SLURM_STEP_TASKS_PER_NODE='4\(x\)'"),
    ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x0)"}, r"SLURM_STEP_TASKS_PER_NODE='4\(x0\)'"),
    ({**STEP, "SLURM_STEP_TASKS_PER_NODE": "4,3"}, r"SLURM_STEP_TASKS_PER_NODE='4,3' makes 7 tasks, but SLURM_STEP"),
    (
        {**STEP, "SLURM_STEP_TASKS_PER_NODE": "4,2(x2)", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8"},
        r"SLURM_STEP_TASKS_PER_NODE='4,2\(x2\)' counts 3 node\(s\), but SLURM_STEP_NODELIST='node\[01-02\]' lists 2",
    ),
    ({**STEP, "SLURM_STEP_NUM_NODES": "3"}, r"SLURM_STEP_NUM_NODES=3, but SLURM_STEP_NODELIST='node\[01-02\]'"),
    ({**STEP, "SLURM_NTASKS": "many", "SLURM_STEP_NUM_TASKS": "many"}, r"SLURM_STEP_NUM_TASKS='many'"),
    (without(STEP, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"), r"neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS"),
    # the rendezvous wait itself
    ({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "soon"}, r"TXL_RENDEZVOUS_TIMEOUT='soon'"),
    ({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "0"}, r"TXL_RENDEZVOUS_TIMEOUT='0'"),
    ({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "-3"}, r"TXL_RENDEZVOUS_TIMEOUT='-3'"),
    # every numeric variable says what it may be
    ({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "1e12"}, r"='1e12': .*a number above 0 and below 1,000,000 \(default"),
    ({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "1000000"}, r"above 0 and below 1,000,000"),
    ({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "nan"}, r"above 0 and below 1,000,000"),
    ({"MASTER_PORT": "65536"}, r"MASTER_PORT=65536 is not a TCP port \(1 to 65535; 0 in a world of one"),
    ({**STEP, "SLURM_LOCALID": "9"}, r"local rank 9 of 4 .*: a local rank runs from 0 to one below the node's rank"),
]


@pytest.mark.parametrize(("environ", "message"), REFUSED, ids=[re.sub(r"\W+", "_", m)[:60] for _, m in REFUSED])
def test_an_impossible_or_half_given_launch_is_refused_in_one_line_naming_the_variable(environ, message):
    with pytest.raises(LaunchError, match=message) as refused:
        launch_env.apply(dict(environ))
    assert "\n" not in str(refused.value)


def test_the_consistent_neighbours_of_the_refused_launches_are_read_as_given():
    launch = resolve(STEP)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (
        "slurm",
        3,
        8,
        3,
        4,
    )
    assert launch.master_addr == "node01"
    last = resolve({**STEP, "SLURM_PROCID": "7", "SLURM_NODEID": "1"})
    assert (last.rank, last.local_world_size, last.master_addr) == (7, 4, "node01")
    # Slurm's own PMI plugins set PMI_RANK in a step: the step's variables say the rest.
    assert resolve({**STEP, "PMI_RANK": "3"}).launcher == "slurm"
    assert resolve({"RANK": "0", "WORLD_SIZE": "1", **TORCH, "MASTER_PORT": "1"}).master_port == 1
    assert resolve({"LOCAL_RANK": "0"}).world_size == 1
    # DeepSpeed's mpich and impi launchers export WORLD_SIZE beside the MPI's own rank and size.
    assert resolve({**PMI, "WORLD_SIZE": "2", "MASTER_PORT": "29500"}).launcher == "mpich"
    # A world of one takes the address and port it is given; 0 picks a free one, which torch then reads.
    single = {"MASTER_ADDR": "localhost", "MASTER_PORT": "0"}
    launch = launch_env.apply(single)
    assert launch.master_port > 0 and single["MASTER_PORT"] == str(launch.master_port)
    assert single["MASTER_ADDR"] == "localhost" and single["RANK"] == "0"
    assert expand_hostlist("gpu[001-003,010]-ib,login") == ["gpu001-ib", "gpu002-ib", "gpu003-ib", "gpu010-ib", "login"]
    assert launch_env.rendezvous_timeout_s({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "2.5"}) == 2.5
    assert launch_env.rendezvous_timeout_s({launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "999999"}) == 999999
    at_the_limit = expand_hostlist("a[1-50000],b[00001-49999],c")
    assert len(at_the_limit) == 100_000 and at_the_limit[50_000] == "b00001" and at_the_limit[-1] == "c"
    assert len(expand_hostlist("r[0-9]n[0-99]g[0-99]")) == 100_000


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2", **TORCH}, "RANK='2'"),
        ({"RANK": "0", "WORLD_SIZE": "-2", **TORCH}, "WORLD_SIZE='-2'"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE='4'"),
        ({**STEP, "SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc'"),
        ({"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR='no-such-host.invalid' does not resolve"),
        ({**STEP, "SLURM_STEP_NODELIST": "nosuchnode-x[1-2].invalid"}, "SLURM_STEP_NODELIST (its first host)="),
    ],
)
def test_the_command_line_prints_no_impossible_world(environ, named):
    """`python -m txl_dist.rendezvous.launch_env` shows only a launch that can happen: the rest exits 2 with one
    line."""
    result = run_launch_env(**environ)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.stderr


# ---- launchers/train.py in a Slurm batch script, and a rendezvous host that does not resolve -------------------------


BATCH_STEP = {  # the batch script of `sbatch --ntasks 4 --nodes 2`: the job's variables, no step of its own
    "SLURM_JOB_ID": "57",
    "SLURM_JOBID": "57",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "txlnode[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_TASK_PID": "4242",
}


def _launch_variables_cleared(monkeypatch) -> None:
    """No launcher's variable in this process, and every variable `apply` writes given back after the test."""
    written = tuple(launch_env.LaunchEnvironment("single", 0, 1, 0, 1, "", 0).torch_variables())
    for key in (*written, launch_env.SINGLE_RANK_VARIABLE, launch_env.RENDEZVOUS_TIMEOUT_VARIABLE):
        monkeypatch.setenv(key, "")  # records the original value (or its absence) for the test's end
        monkeypatch.delenv(key)
    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "TORCHELASTIC")):
            monkeypatch.delenv(key)


@pytest.mark.parametrize("step_id", [None, "4294967294"])
def test_train_py_in_the_batch_script_of_a_4_task_allocation_is_refused_unless_asked_for(step_id, monkeypatch):
    """`python launchers/train.py` typed in the batch script (no srun) would train on one task of the four: it is
    refused before anything starts, naming srun; an allocation of one task, or TXL_SINGLE_RANK=1, runs alone."""

    _launch_variables_cleared(monkeypatch)
    for key, value in {**BATCH_STEP, **({"SLURM_STEP_ID": step_id} if step_id else {})}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchError, match=r"Slurm job 57, an allocation of 4 tasks: start the ranks with `srun"):
        _apply_launch()
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    monkeypatch.delenv("SLURM_NTASKS")  # sbatch --nodes 2 alone: one task a node by default, still two
    with pytest.raises(LaunchError, match=r"an allocation of 4 tasks"):
        _apply_launch()
    monkeypatch.setenv(launch_env.SINGLE_RANK_VARIABLE, "1")
    launch = _apply_launch()
    assert os.environ["WORLD_SIZE"] == "1" and launch.name == "single"
    _launch_variables_cleared(monkeypatch)
    for key, value in {**BATCH_STEP, "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}.items():
        monkeypatch.setenv(key, value)
    _apply_launch()
    assert os.environ["WORLD_SIZE"] == "1"
    # Launched by torchrun or mpirun inside the batch script: their own world, nothing refused.
    _launch_variables_cleared(monkeypatch)
    for key, value in {**BATCH_STEP, **OMPI, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    _apply_launch()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")


def test_train_py_refuses_a_rendezvous_host_that_does_not_resolve_before_anything_starts(monkeypatch):

    _launch_variables_cleared(monkeypatch)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", **TORCH, "MASTER_ADDR": "no-such-host.invalid"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchError, match=r"^MASTER_ADDR='no-such-host.invalid' does not resolve"):
        _apply_launch()


def _apply_launch():
    """launchers/train.py's step 2 (`txl_dist.training.startup.apply_launch`) on this process's variables."""
    from txl_dist.training import startup

    return startup.apply_launch(*startup.read_launch())


# ---- a rendezvous that never completes ends within its timeout -------------------------------------------------------


def _environment_without_a_launch(**environ: str) -> dict[str, str]:
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "TORCHELASTIC"))
        and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**base, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **environ}


def test_a_rank_whose_rendezvous_never_opens_says_so_in_one_line_within_its_timeout(ptb_word_shards, tmp_path):
    """Rank 1 of 2 started by hand, rank 0 never: launchers/train.py ends after TXL_RENDEZVOUS_TIMEOUT with one
    line naming the address, the port and the rank (torch alone waits 600 s, printing C++ stack traces)."""
    port = free_port()
    peerless = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    result = subprocess.run(
        [
            PYTHON,
            "launchers/train.py",
            "--config",
            "configs/tiny_cpu.yaml",
            f"data.shards={ptb_word_shards}",
            f"train.output_dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=_environment_without_a_launch(**peerless, MASTER_PORT=str(port), TXL_RENDEZVOUS_TIMEOUT="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1, result.stderr[-3000:]
    waited = rf"train.py: error(?: on rank 1 \(.*\))?: rank 1 of 2 waited 3 s for the rendezvous at 127.0.0.1:{port} "
    assert re.match(waited, last), last
    assert "TXL_RENDEZVOUS_TIMEOUT" in last
    assert "Traceback" not in result.stderr and "frame #" not in result.stderr, result.stderr[-3000:]


def test_a_rank_0_whose_peers_never_come_says_so_in_one_line_within_its_timeout(monkeypatch):
    """Rank 0 of 2 alone: its store waits TXL_RENDEZVOUS_TIMEOUT for the other rank, then one line says how many
    came (a real store, in this process: torch is imported here already)."""
    from txl_dist.rendezvous import process_group

    port = free_port()
    _launch_variables_cleared(monkeypatch)
    alone = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in {**alone, launch_env.RENDEZVOUS_TIMEOUT_VARIABLE: "2"}.items():
        monkeypatch.setenv(key, value)
    started = time.monotonic()
    with pytest.raises(LaunchError) as refused:
        process_group._rendezvous(launch_env.apply())
    message = str(refused.value)
    assert message.startswith(f"rank 0 of 2 waited at most 2 s at 127.0.0.1:{port} for the other ranks"), message
    assert "1/2 clients joined" in message and "\n" not in message
    assert time.monotonic() - started < 30
    with socket.socket() as taken:  # another program holds the port: one line at once, not a wait
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(
            LaunchError, match=r"^rank 0 of 2 cannot open the rendezvous at 127.0.0.1:\d+ \(MASTER_PORT\)"
        ):
            process_group._rendezvous(launch_env.apply())
