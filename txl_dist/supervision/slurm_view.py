"""Slurm's view of a job's nodes, and the nodes that the ranks' fault records name: what the batch script's
relaunch decision (`txl_dist.supervision.relaunch`) reads of the cluster.

Every question goes to Slurm's own commands (``scontrol show job``, ``scontrol show node``, and a one-task ``srun``
that probes a node: `node_answers`); host lists are read by `txl_dist.rendezvous.launch_formats.expand_hostlist`,
the one parser of them. An answer this module cannot read is a `SlurmQueryError` naming the command.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping, Sequence

from txl_dist.rendezvous.launch_formats import LaunchError, expand_hostlist
from txl_dist.supervision import faults

USABLE_BASE_STATES = frozenset({"ALLOCATED", "MIXED", "IDLE", "COMPLETING"})
"""The base states of a node (scontrol's State= before the first +, sinfo's %T) that take job steps (sinfo(1),
NODE STATE CODES); every other one (DOWN, DRAINED, FAIL, FUTURE, INVAL, UNKNOWN, a state a newer Slurm adds, ...)
does not."""
USABLE_STATE_FLAGS = frozenset({"COMPLETING", "CLOUD", "RESERVED", "MAINT", "MAINTENANCE", "PLANNED", "DYNAMIC_NORM"})
"""The flags after a usable base state (``MIXED+COMPLETING``) that still let steps run: jobs ending, a cloud node,
a reservation (a maintenance one too), a backfill plan. Every other flag (DRAIN, FAIL, NOT_RESPONDING, POWER_*,
REBOOT_*, INVALID_REG, ...) keeps new steps off."""
USABLE_STATE_SUFFIXES = "$-"
"""sinfo's one-character suffixes (``idle$``) that leave a node usable: a maintenance reservation, a backfill plan;
``*`` (not responding), ``~ # ! %`` (power) and ``@ ^`` (reboot) do not."""

SCONTROL_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 30.0
"""How long a node named by the ranks has to run a trivial step (`node_answers`) before it counts as lost: a live
slurmd answers in well under a second; a dead host fails at once (refused) or after Slurm's MessageTimeout (10 s
by default)."""


class SlurmQueryError(RuntimeError):
    """scontrol failed or answered something this module cannot read; the message names the command."""


def _scontrol(*args: str) -> str:
    command = ["scontrol", *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SlurmQueryError(f"{' '.join(command)}: {error}") from error
    if result.returncode != 0:
        raise SlurmQueryError(f"{' '.join(command)} failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout


FREE_TEXT_ENDS = {"JobName": "UserId"}
"""A free-text field that Slurm prints before the fields read here, and the key it always prints next: its value
runs up to that key when there is one, whatever it fits (a job name may hold spaces and ``KEY=``). The free-text
fields printed after them (Comment, Reason, Command, WorkDir, StdOut, ...) cannot shadow them: the first value of a
key counts."""


_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol show -o`` record as a dict (values may contain spaces, as Reason= does). Slurm prints each
    key once, and the free-text fields that could hold `` KEY=`` (Comment=, a node's Reason=) after the fields this
    module reads: the first value of a key is Slurm's, a later one is text inside another field."""
    record: dict[str, str] = {}
    match = _KEY.search(line)
    while match:
        key = match.group(1)
        ends_at = FREE_TEXT_ENDS.get(key)
        following = ends_at and re.compile(rf"\s({ends_at})=").search(line, match.end())
        following = following or _KEY.search(line, match.end())
        record.setdefault(key, line[match.end() : following.start() if following else len(line)].strip())
        match = following
    return record


def hostnames(nodelist: str) -> list[str]:
    """A Slurm host list (``node[1-3],gpu7``) as names, in Slurm's order; [] for an empty or (null) list."""
    if nodelist.strip() in ("", "(null)"):
        return []
    try:
        return expand_hostlist(nodelist)
    except LaunchError as error:  # Slurm's own list, unreadable: the safe verdict, not a refused command line
        raise SlurmQueryError(str(error)) from None


def usable(state: str) -> bool:
    """Whether a node in STATE (``IDLE``, ``MIXED+COMPLETING``, ``allocated$``) takes job steps: a base state and
    flags that Slurm documents as usable; any other state, flag or suffix (``MIXED+DRAIN``, ``DOWN``, ``idle*``,
    ``INVAL``, an empty state) does not."""
    parts = state.strip().upper().split("+")
    base, flags = parts[0], [flag for flag in parts[1:] if flag]  # sinfo's ALLOCATED+: jobs completing
    stripped = base.rstrip("*~#!%$@^-")
    if base[len(stripped) :].strip(USABLE_STATE_SUFFIXES) or stripped not in USABLE_BASE_STATES:
        return False
    return all(flag in USABLE_STATE_FLAGS for flag in flags)


def describe_state(state: str | None) -> str:
    """A node's state for the job's log: ``State=DOWN``, or why there is none."""
    if state is None:
        return "unknown to Slurm"
    return f"State={state}" if state.strip() else "no state reported"


def node_states(nodes: Sequence[str]) -> dict[str, str]:
    """Node -> its State= as slurmctld sees it now; a node Slurm no longer knows is missing from the result."""
    if not nodes:
        return {}
    states = {}
    for line in _scontrol("show", "node", "-o", ",".join(nodes)).splitlines():
        record = parse_record(line)
        if "NodeName" in record:
            states[record["NodeName"]] = record.get("State", "")
    return states


def job_record(job_id: str) -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict (NodeList, Requeue, Restarts, ...); SlurmQueryError when the answer
    is no record of that job (blank, or another job's): what Slurm did to the job is then unknown."""
    lines = [line for line in _scontrol("show", "job", "-o", job_id).splitlines() if line.strip()]
    record = parse_record(lines[0]) if lines else {}
    if "JobId" not in record or "NodeList" not in record:
        answer = lines[0][:80] if lines else "nothing"
        raise SlurmQueryError(f"scontrol show job -o {job_id} answered no record of the job ({answer!r})")
    return record


def lost_nodes(step_nodes: Sequence[str], job_nodes: Sequence[str], states: Mapping[str, str]) -> dict[str, str]:
    """The nodes of the step that the next step cannot use, each with why (in Slurm's words)."""
    lost = {}
    for node in step_nodes:
        if node not in job_nodes:
            lost[node] = f"removed from the job by Slurm, {describe_state(states.get(node))}"
        elif not usable(states.get(node, "")):
            lost[node] = describe_state(states.get(node))
    return lost


def node_answers(job: str, node: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Whether Slurm can still run a step on NODE in JOB: None when a trivial one ran there, else why not (srun's
    last line). This is the question Slurm itself answers only after SlurmdTimeout; asked here, it takes a second
    on a live node and at most TIMEOUT on a dead one."""
    command = [
        "srun",
        f"--jobid={job}",
        "--overlap",
        "--mem=0",
        "--nodes=1",
        "--ntasks=1",
        "--cpus-per-task=1",
        f"--nodelist={node}",
        "--quiet",
        "hostname",
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"no answer to srun within {timeout:.0f} s"
    except OSError as error:
        return f"srun: {error}"
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        return f"srun failed (exit {result.returncode}): {lines[-1] if lines else 'no message'}"
    return None


def node_of(record: Mapping, step_nodes: Sequence[str], ranks_per_node: int) -> str | None:
    """The node of the step that a rank's fault record names: by the host the rank published, else by its rank
    (Slurm's block distribution: rank r on node r // ranks_per_node, in Slurm's order of the step's nodes)."""
    host = record.get("host")
    if isinstance(host, str) and host:
        for node in step_nodes:
            if host == node or host.split(".")[0] == node.split(".")[0]:
                return node
    rank = faults.whole(record.get("rank"))
    if rank is not None and record.get("world_size") == len(step_nodes) * ranks_per_node:
        return step_nodes[rank // ranks_per_node]
    return None


def named_by_the_ranks(
    records: Sequence[Mapping],
    step_nodes: Sequence[str],
    ranks_per_node: int,
    answers: Callable[[str], str | None],
) -> dict[str, str]:
    """The nodes that the ranks' records of the failed step leave out, each with why: the host of a rank that
    stalled (its process or its host is stuck), and the host of a rank that died or that the others lost contact
    with, unless Slurm still runs a step there (ANSWERS: `node_answers`), which makes it a healthy node whose rank
    failed."""
    named: dict[str, str] = {}
    for record in records:
        kind = record.get("kind")
        if kind != "stalled" and kind not in faults.NODE_SUSPECT_KINDS:
            continue
        node = node_of(record, step_nodes, ranks_per_node)
        if node is None or node in named:
            continue
        if kind == "stalled":
            named[node] = f"named by the ranks: {faults.describe(record)}"
            continue
        why_not = answers(node)
        if why_not is not None:
            named[node] = f"named by the ranks and no step runs there: {why_not}"
    return named
