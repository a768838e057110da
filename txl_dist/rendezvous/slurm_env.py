"""What Slurm's variables say about a process: whether it is a task of an srun step or the batch script, the
step's placement (tasks on this node and the first host, each list checked against the node id and the others),
the port a step's tasks agree on without talking, and how many tasks an allocation has."""

from __future__ import annotations

from collections.abc import Mapping

from txl_dist.rendezvous.launch_formats import LaunchError, env_int, expand_hostlist, tasks_per_node


def step_port(environ: Mapping[str, str]) -> int:
    """A port all tasks of a step agree on without talking: derived from the job and step ids (two steps of one
    job, or two jobs on one node, get different ports unless their ids collide modulo 20,000)."""
    job = env_int(environ, "SLURM_JOB_ID") if "SLURM_JOB_ID" in environ else 0
    step = env_int(environ, "SLURM_STEP_ID") if "SLURM_STEP_ID" in environ else 0
    return 20000 + (job * 7 + step) % 20000


_SLURM_SPECIAL_STEPS = 0xFFFFFFF0
"""Step ids from here up are Slurm's own (the batch script is 0xFFFFFFFE, the extern step 0xFFFFFFFC)."""


def in_step(environ: Mapping[str, str]) -> bool:
    """srun's tasks have a step id of their own; the batch script (also SLURM_PROCID=0) has none, or a special one."""
    if "SLURM_PROCID" not in environ or "SLURM_STEP_ID" not in environ:
        return False
    return env_int(environ, "SLURM_STEP_ID") < _SLURM_SPECIAL_STEPS


def placement(environ: Mapping[str, str], node_index: int) -> tuple[int | None, str | None]:
    """(tasks on this node, first host of the step) from the step's lists, each checked against the node id and
    the other lists; None where Slurm gave no list."""
    step = "SLURM_STEP_TASKS_PER_NODE" in environ
    per_node_key = "SLURM_STEP_TASKS_PER_NODE" if step else "SLURM_TASKS_PER_NODE"
    nodes_key = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
    counts = tasks_per_node(environ[per_node_key], per_node_key) if environ.get(per_node_key) else None
    hosts = expand_hostlist(environ[nodes_key], nodes_key) if nodes_key in environ else None
    for listed, key in ((counts, per_node_key), (hosts, nodes_key)):
        if listed is not None and node_index >= len(listed):
            raise LaunchError(
                f"SLURM_NODEID={node_index}, but {key}={environ[key]!r} lists {len(listed)} node(s): "
                "the step's variables disagree"
            )
    for count_key, listed, key in (
        ("SLURM_STEP_NUM_NODES", hosts if nodes_key == "SLURM_STEP_NODELIST" else None, nodes_key),
        ("SLURM_JOB_NUM_NODES", hosts if nodes_key == "SLURM_JOB_NODELIST" else None, nodes_key),
    ):
        if count_key in environ and listed is not None and env_int(environ, count_key) != len(listed):
            raise LaunchError(
                f"{count_key}={environ[count_key]}, but {key}={environ[key]!r} lists {len(listed)} node(s)"
            )
    if step and nodes_key == "SLURM_STEP_NODELIST" and counts and hosts and len(counts) != len(hosts):
        raise LaunchError(
            f"SLURM_STEP_TASKS_PER_NODE={environ[per_node_key]!r} counts {len(counts)} node(s), but "
            f"SLURM_STEP_NODELIST={environ[nodes_key]!r} lists {len(hosts)}"
        )
    if step and "SLURM_STEP_NUM_TASKS" in environ and counts is not None:
        if sum(counts) != env_int(environ, "SLURM_STEP_NUM_TASKS"):
            raise LaunchError(
                f"SLURM_STEP_TASKS_PER_NODE={environ[per_node_key]!r} makes {sum(counts)} tasks, but "
                f"SLURM_STEP_NUM_TASKS={environ['SLURM_STEP_NUM_TASKS']}"
            )
    return (counts[node_index] if counts else None), (hosts[0] if hosts else None)


def allocation_tasks(environ: Mapping[str, str]) -> int:
    """The task count of the Slurm allocation this process runs in (SLURM_NTASKS, else its nodes' task counts)."""
    if "SLURM_NTASKS" in environ:
        return env_int(environ, "SLURM_NTASKS")
    if environ.get("SLURM_TASKS_PER_NODE"):
        return sum(tasks_per_node(environ["SLURM_TASKS_PER_NODE"], "SLURM_TASKS_PER_NODE"))
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if key in environ:
            return env_int(environ, key)
    return 1
