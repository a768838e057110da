"""Which launcher started a rank (txl_dist.launch_env): the variables of torchrun/deepspeed, srun, mpirun and a
plain process, read into one world; and `.deepspeed_env` for pdsh. The launches themselves run for real in
tests/cluster/ and tests/test_liveness.py."""

from __future__ import annotations

import pytest

from txl_dist import launch_env
from txl_dist.launch_env import LaunchError, expand_hostlist, resolve


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
