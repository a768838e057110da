"""Slurm's view of a job's nodes, the ranks' record of a failure, and the relaunch decision of
``launchers/slurm.sbatch`` (docs: "Elastic runs").

The batch script decides every restart of a Slurm job; this module is the part of it that reads Slurm and the
run. When the training step ends non-zero without a stop request, the script asks::

    python -m txl_dist.world.slurm_nodes relaunch --job JOB --step-nodes NODES --ranks-per-node R --relaunches K \\
        --spares SPARES --status STATUS --launch JOB.RESTART.K -- TRAIN_ARGS...

which prints one line on stdout: ``relaunch N NODELIST SPARES`` (start the step again on those N nodes, keeping
SPARES, ``-`` for none, idle), ``requeue`` (a node was lost but the job cannot go on: below ``TXL_MIN_NODES``, past
``TXL_MAX_RELAUNCHES``, or no smaller world holds the global batch; the job is requeueable, so it goes back to the
queue as a node failure did before) or ``end`` (the job ends with the step's status). Its reasons go to stderr, the
job's log, in one line each.

What it reads:

- Slurm: a node counts as lost when Slurm has taken it out of the job (``--no-kill`` jobs keep running without a
  failed node, whose ``NodeList`` no longer names it) or its state is not one that Slurm documents as usable (IDLE,
  MIXED, ALLOCATED, COMPLETING, with flags that keep steps running: `usable`); DOWN, DRAIN, FAIL, NOT_RESPONDING,
  INVAL, no state at all, ... keep it out.
- The ranks (the run's fault log, `txl_dist.world.faults`): Slurm notices a dead node only after SlurmdTimeout
  (300 s by default); the ranks name a dead or stalled rank within seconds. The host of a stalled rank is left out
  at once; the host of a rank that died is left out when Slurm cannot run a one-task step there (`node_answers`),
  and is a healthy node otherwise. ``python -m txl_dist.world.slurm_nodes watch`` ends a step whose ranks named a
  lost rank while srun still waits for that node, so that this decision comes at once.

What it decides: with a node lost, a spare (``TXL_SPARE_NODES``) takes its place, so the world keeps its size;
without spares the step goes on the nodes left. With every node healthy (a rank killed by the OOM killer, a
crash), the step starts again on the same nodes, unless a rank refused its input (exit 2, a ``refused`` record),
or the failure came back at the same step after a relaunch (the script's own ``plan`` records in the fault log),
or the relaunches are used up: then the job ends, with one line naming the step, the rank and its last error line.
Where this module cannot read Slurm's view (a failed, blank or foreign ``scontrol`` answer) or the run (a config
file gone), or fails itself, it answers the safe verdict: ``requeue`` (``end`` for a job known not to be
requeueable), never the end of a job that could go on; a damaged line of metrics.jsonl or of the fault log is
skipped with a warning naming the file and the line. ``python -m txl_dist.world.slurm_nodes check`` validates the
batch script's variables at the start of the job (exit 2 with one line naming the variable).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from txl_dist.checkpoints.layout import complete_tags, step_of_tag
from txl_dist.config import load_config
from txl_dist.config.files import read_layers
from txl_dist.exit_status import one_line, run_command
from txl_dist.run_layout import METRICS, checkpoints_dir, fault_log
from txl_dist.world import faults

MIN_NODES_VAR = "TXL_MIN_NODES"
MAX_RELAUNCHES_VAR = "TXL_MAX_RELAUNCHES"
RANKS_PER_NODE_VAR = "TXL_RANKS_PER_NODE"
SPARE_NODES_VAR = "TXL_SPARE_NODES"
MOST_RANKS_PER_NODE = 4096
"""The bound of TXL_RANKS_PER_NODE: far above any node's devices, and far below what the batch script's arithmetic
holds."""
DEFAULT_MIN_NODES = 1
DEFAULT_MAX_RELAUNCHES = 3
"""Relaunches per run of a job: a node lost every few days costs one; a fourth within one allocation means the
nodes left are suspect too, and the queue (with its fresh nodes) is the better place to wait."""

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
STEP_END_GRACE_S = 10.0
"""`watch`: after the ranks named a rank dead or stalled, how long srun may take to end by itself before the batch
script stops waiting for it (the ranks on healthy nodes end within a few seconds of the report; srun itself waits
for a dead node until Slurm marks it DOWN, SlurmdTimeout: 300 s by default)."""
SAME_STEP_SLACK = 1
"""Steps by which two failures may differ and still be "the same step": the ranks that name a dead one may stand one
step apart (each waits in the next step's all-reduce), so a fault that kills a rank at step S is recorded at S or
S + 1 by whichever rank reports it."""
REFUSED_INPUT_STATUS = 2
"""The exit status of a rank that refused its input (txl_dist.exit_status.USAGE_ERROR): never retried."""


class SlurmQueryError(RuntimeError):
    """scontrol failed or answered something this module cannot read; the message names the command."""


class RunLogError(ValueError):
    """A line of metrics.jsonl that is not a train record this module can read; the message says why."""


@dataclass(frozen=True)
class Limits:
    """The job's relaunch limits, from the environment of the batch script."""

    min_nodes: int = DEFAULT_MIN_NODES
    max_relaunches: int = DEFAULT_MAX_RELAUNCHES
    spare_nodes: int = 0


def _whole(environ: Mapping[str, str], name: str, default: int, least: int, most: int | None = None) -> int:
    text = environ.get(name, "").strip(" \t\n\r\f\v")  # the blanks that the batch script strips too
    if not text:
        return default
    if not re.fullmatch(r"[0-9]+", text) or int(text) < least or (most is not None and int(text) > most):
        allowed = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise ValueError(f"{name}={text!r} is not allowed: a whole number {allowed}")
    return int(text)


def read_limits(environ: Mapping[str, str] = os.environ, job_nodes: int | None = None) -> Limits:
    """TXL_MIN_NODES (default 1, at least 1), TXL_MAX_RELAUNCHES (default 3, at least 0) and TXL_SPARE_NODES
    (default 0: the nodes of the job kept idle to replace a lost one); with JOB_NODES, the job's node count, the
    spares must leave at least TXL_MIN_NODES nodes to train on. ValueError naming the variable and its value.
    TXL_RANKS_PER_NODE, read by the batch script alone, is checked here too (unset, or at least 1), so that every
    variable of the script is refused in one place."""
    _whole(environ, RANKS_PER_NODE_VAR, 1, 1, MOST_RANKS_PER_NODE)
    limits = Limits(
        _whole(environ, MIN_NODES_VAR, DEFAULT_MIN_NODES, 1),
        _whole(environ, MAX_RELAUNCHES_VAR, DEFAULT_MAX_RELAUNCHES, 0),
        _whole(environ, SPARE_NODES_VAR, 0, 0),
    )
    if job_nodes is not None and limits.min_nodes > job_nodes:
        raise ValueError(
            f"{MIN_NODES_VAR}={limits.min_nodes} is more than the job's {job_nodes} node(s): the job could never "
            "start; allowed: 1 to the number of nodes"
        )
    if job_nodes is not None and job_nodes - limits.spare_nodes < limits.min_nodes:
        raise ValueError(
            f"{SPARE_NODES_VAR}={limits.spare_nodes} leaves {max(0, job_nodes - limits.spare_nodes)} of the job's "
            f"{job_nodes} node(s) to train on, fewer than {MIN_NODES_VAR}={limits.min_nodes}; allowed: 0 to "
            f"{job_nodes - limits.min_nodes}"
        )
    return limits


# ---- Slurm's view ---------------------------------------------------------------------------------------------


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
runs up to that key when there is one, whatever it holds (a job name may hold spaces and ``KEY=``). The free-text
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
    return _scontrol("show", "hostnames", nodelist).split()


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


# ---- the run's side -------------------------------------------------------------------------------------------


def train_step(line: bytes) -> int | None:
    """The step of one metrics.jsonl line when it is a train record, None for another kind of record; RunLogError
    saying why for a line that is no record this module can read (not UTF-8 or JSON, not an object, a train record
    whose step is not a whole number)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunLogError("not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise RunLogError(f"not a JSON record ({error.msg})") from None
    if not isinstance(record, dict):
        raise RunLogError(f"a JSON {type(record).__name__}, not a record")
    if record.get("kind") != "train":
        return None
    step = record.get("step")
    if type(step) is not int or step < 0:
        raise RunLogError(f"a train record whose step is {step!r}, not a whole number")
    return step


def logged_step(path: Path, say: Callable[[str], None]) -> int | None:
    """The newest step of the train records in metrics.jsonl at PATH (None without one). A line that is no record
    (the one a dying rank was writing, or a damaged one) is skipped: SAY names the file, the line and why, and the
    other lines and the checkpoints decide."""
    logged = None
    skipped: list[str] = []
    try:
        with open(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    step = train_step(line)
                except RunLogError as error:
                    skipped.append(f"line {number}: {error}")
                    continue
                if step is not None:
                    logged = max(logged or 0, step)
    except OSError:
        pass
    if skipped:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        say(f"warning: {path}: skipped {len(skipped)} unreadable line(s) ({'; '.join(skipped[:3])}{more})")
    return logged


def run_progress(output_dir: Path, say: Callable[[str], None] = lambda line: None) -> tuple[int | None, int | None]:
    """(the newest step reached, the newest checkpoint step with a completion marker) of a run. The step reached
    is the newest train record of metrics.jsonl or the newest checkpoint, whichever is later: a save on the clock
    (checkpoint.every_minutes) may come between two logged steps, and the log may be gone.

    The trainer verifies the checkpoint before it trusts it and falls back to an older one, so the second number
    is where the relaunch resumes when that checkpoint is whole, which it is unless the disk damaged it."""
    logged = logged_step(output_dir / METRICS, say)
    checkpointed = None
    tags = complete_tags(checkpoints_dir(output_dir))
    if tags:
        checkpointed = step_of_tag(tags[-1])
    if checkpointed is not None:
        logged = max(logged or 0, checkpointed)
    return logged, checkpointed


def largest_world(
    healthy: int, ranks_per_node: int, min_nodes: int, holds: Callable[[int], bool]
) -> tuple[int | None, list[int]]:
    """The most nodes (at most HEALTHY, at least MIN_NODES) whose ranks hold the global batch (HOLDS(world)), and
    the node counts that were refused; None when no count does."""
    refused = []
    for nodes in range(healthy, min_nodes - 1, -1):
        if holds(nodes * ranks_per_node):
            return nodes, refused
        refused.append(nodes)
    return None, refused


def _config_args(train_args: Sequence[str]) -> tuple[list[str], list[str]]:
    """The --config files and the key.path=value overrides among train.py's arguments."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("overrides", nargs="*")
    known, _ = parser.parse_known_intermixed_args(list(train_args))
    return known.config, [item for item in known.overrides if "=" in item]


def output_dir_of(train_args: Sequence[str]) -> Path | None:
    """train.output_dir as the ranks read it (the files and overrides merged; YAML alone, no imports of torch)."""
    data, _ = read_layers(*_config_args(train_args))
    train = data.get("train")
    output_dir = train.get("output_dir") if isinstance(train, dict) else None
    return Path(output_dir) if output_dir else None


def batch_holds(train_args: Sequence[str], old_world: int) -> Callable[[int], bool]:
    """Whether a world of N ranks holds the run's global batch (`TrainConfig.batch_layout`, the one place of the
    rule). A world that divides OLD_WORLD always does (its accumulation is a multiple of the old one), so the full
    config is read only for the others."""
    cfg = None

    def holds(world: int) -> bool:
        nonlocal cfg
        if old_world % world == 0:
            return True
        if cfg is None:
            cfg = load_config(*_config_args(train_args))
        try:
            cfg.train.batch_layout(world)
        except ValueError:
            return False
        return True

    return holds


# ---- the ranks' view --------------------------------------------------------------------------------------------


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


# ---- the decision -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Situation:
    """What the decision reads: the step that ended, Slurm's view of the job after it, and what the ranks
    recorded (`txl_dist.world.faults`)."""

    step_nodes: list[str]
    job_nodes: list[str]
    states: dict[str, str]
    batch_host: str
    ranks_per_node: int
    relaunches: int
    requeueable: bool
    spares: list[str] = field(default_factory=list)
    status: int | None = None
    """The step's exit status (srun's), None when unknown."""
    failures: list[dict] = field(default_factory=list)
    """The ranks' fault records of the step that ended."""
    named: dict[str, str] = field(default_factory=dict)
    """Nodes the ranks' records leave out (`named_by_the_ranks`), with why."""
    previous_failure: int | None = None
    """The step at which the previous training step of this job failed, when it did on healthy nodes too."""
    launch: str = ""
    """The failed step's name in the fault log (`txl_dist.world.faults.launch_id`)."""


def _give_up(situation: Situation, since: str) -> tuple[str, str]:
    if situation.requeueable:
        return "requeue", f"requeueing the job (its next run resumes from {since})"
    return "end", f"ending the job (the same command resumes from {since})"


def _progress_words(progress: tuple[int | None, int | None]) -> tuple[str, str, int]:
    logged, checkpointed = progress
    at = f"at step {logged}" if logged is not None else "before its first logged step"
    since = f"checkpoint step {checkpointed}" if checkpointed is not None else "the start (no checkpoint yet)"
    return at, since, max(0, (logged or 0) - (checkpointed or 0))


def failed_at(situation: Situation, progress: tuple[int | None, int | None]) -> int | None:
    """The training step at which the step failed: the ranks' record, else the newest step reached."""
    for record in situation.failures:
        step = faults.whole(record.get("step"))
        if step is not None:
            return step
    return progress[0]


def retry_on_the_same_nodes(
    situation: Situation, limits: Limits, progress: tuple[int | None, int | None], say: Callable[[str], None]
) -> str:
    """The decision after a step failed on nodes that are all healthy (Slurm's view and the ranks' agree): the
    same nodes again, so the world and the run are those of the uninterrupted run, unless the failure refused the
    input, came back at the same step after a relaunch, or the relaunches are used up; then the job ends (a
    failure on healthy nodes is not one that the queue cures)."""
    what = faults.describe(situation.failures[0]) if situation.failures else "no rank recorded why"
    nodes = ", ".join(f"{node} {situation.states.get(node, '?')}" for node in situation.step_nodes)
    refused = any(record.get("kind") == "refused" for record in situation.failures)
    if refused or situation.status == REFUSED_INPUT_STATUS:
        say(f"a rank refused its input ({what}): a relaunch would be refused the same way, so the job ends")
        return "end"
    step = failed_at(situation, progress)
    previous = situation.previous_failure
    if step is not None and previous is not None and abs(step - previous) <= SAME_STEP_SLACK:
        say(
            f"the failure came back at step {step} after a relaunch ({what}): not retrying it again, the job ends; "
            f"the same command resumes from the newest checkpoint once the cause is fixed"
        )
        return "end"
    if situation.relaunches >= limits.max_relaunches:
        say(
            f"the training step failed on healthy nodes ({what}) after {situation.relaunches} relaunch(es) in this "
            f"job, {MAX_RELAUNCHES_VAR}={limits.max_relaunches}: the job ends"
        )
        return "end"
    at, since, redo = _progress_words(progress)
    world = len(situation.step_nodes) * situation.ranks_per_node
    say(
        f"the training step failed {at} on nodes that are healthy ({nodes}): {what}; relaunch "
        f"{situation.relaunches + 1} of {limits.max_relaunches} ({MAX_RELAUNCHES_VAR}) on the same nodes: world "
        f"{world} as before; resuming from {since}, {redo} step(s) recomputed"
    )
    return _relaunch_line(situation.step_nodes, situation.spares)


def _relaunch_line(nodes: Sequence[str], spares: Sequence[str]) -> str:
    return f"relaunch {len(nodes)} {','.join(nodes)} {','.join(spares) or '-'}"


def take_spares(
    situation: Situation, lost: Mapping[str, str], say: Callable[[str], None]
) -> tuple[list[str], list[str]]:
    """The nodes of the next step: the step's healthy nodes, each lost one replaced by a usable spare in its place
    while spares last; and the spares left. A spare that Slurm took out of the job or marks unusable is dropped."""
    spares = []
    for node in situation.spares:
        if node not in situation.job_nodes or not usable(situation.states.get(node, "")):
            state = situation.states.get(node)
            why = "removed from the job" if node not in situation.job_nodes else describe_state(state)
            say(f"spare {node} is not usable ({why}): dropped")
        else:
            spares.append(node)
    nodes = []
    for node in situation.step_nodes:
        if node not in lost:
            nodes.append(node)
        elif spares:
            spare = spares.pop(0)
            say(f"spare {spare} takes the place of {node}: the world keeps its size")
            nodes.append(spare)
    return nodes, spares


def decide(
    situation: Situation,
    limits: Limits,
    holds: Callable[[int], bool],
    progress: tuple[int | None, int | None],
    say: Callable[[str], None],
) -> str:
    """The line for the batch script (``relaunch N NODES SPARES``, ``requeue`` or ``end``); SAY gets the reasons."""
    lost = lost_nodes(situation.step_nodes, situation.job_nodes, situation.states)
    for node, why in situation.named.items():
        lost.setdefault(node, why)
    if not lost:
        return retry_on_the_same_nodes(situation, limits, progress, say)
    at, since, redo = _progress_words(progress)
    say(f"lost {', '.join(f'{node} ({why})' for node, why in lost.items())} {at}; newest checkpoint: {since}")
    give_up, after = _give_up(situation, since)
    if situation.relaunches >= limits.max_relaunches:
        say(
            f"{situation.relaunches} relaunch(es) in this job already, "
            f"{MAX_RELAUNCHES_VAR}={limits.max_relaunches}: {after}"
        )
        return give_up
    healthy, spares = take_spares(situation, lost, say)
    healthy.sort(key=lambda node: node != situation.batch_host)  # the batch host is alive: keep it, as rank 0
    if len(healthy) < limits.min_nodes:
        say(f"{len(healthy)} node(s) left, fewer than {MIN_NODES_VAR}={limits.min_nodes}: {after}")
        return give_up
    nodes, refused = largest_world(len(healthy), situation.ranks_per_node, limits.min_nodes, holds)
    if nodes is None:
        worlds = ", ".join(str(count * situation.ranks_per_node) for count in refused)
        say(f"the global batch does not split over {worlds} rank(s) (train.global_batch, train.micro_batch): {after}")
        return give_up
    if refused:
        counts = ", ".join(str(count) for count in refused)
        say(f"{counts} node(s) would not hold the global batch; using {nodes} of the {len(healthy)} left")
    chosen = healthy[:nodes]
    old_world = len(situation.step_nodes) * situation.ranks_per_node
    new_world = nodes * situation.ranks_per_node
    batch = "the same micro-batches" if new_world == old_world else "the same global batch"
    say(
        f"relaunch {situation.relaunches + 1} of {limits.max_relaunches} ({MAX_RELAUNCHES_VAR}) on "
        f"{','.join(chosen)}: world {old_world} -> {new_world} rank(s), {batch}; resuming from {since}, {redo} "
        "step(s) recomputed"
    )
    return _relaunch_line(chosen, spares)


def _previous_failure(records: Sequence[Mapping], job: str, restart: str, relaunches: int) -> int | None:
    """The step at which the previous training step of this run of the job failed on healthy nodes (its plan
    record), None when there was none."""
    if relaunches == 0:
        return None
    previous = faults.launch_id(job, restart, relaunches - 1)
    for record in reversed(records):
        if record.get("kind") == faults.PLAN and record.get("launch") == previous and not record.get("lost"):
            return faults.whole(record.get("failed_at"))
    return None


def _situation(args: argparse.Namespace, records: Sequence[Mapping]) -> Situation:
    job = job_record(args.job)
    step_nodes = hostnames(args.step_nodes)
    repeated = sorted({node for node in step_nodes if step_nodes.count(node) > 1})
    if repeated:
        raise ValueError(f"--step-nodes {args.step_nodes!r} names {', '.join(repeated)} more than once")
    spares = [node for node in hostnames(args.spares) if node not in step_nodes] if args.spares != "-" else []
    restart = job.get("Restarts", "0") or "0"
    launch = args.launch or faults.launch_id(args.job, restart, args.relaunches)
    failures = faults.of_launch(records, launch)
    return Situation(
        step_nodes=step_nodes,
        job_nodes=hostnames(job["NodeList"]),
        states=node_states(step_nodes + spares),
        batch_host=job.get("BatchHost", ""),
        ranks_per_node=args.ranks_per_node,
        relaunches=args.relaunches,
        requeueable=job.get("Requeue") == "1",
        spares=spares,
        status=args.status,
        failures=failures,
        named=named_by_the_ranks(failures, step_nodes, args.ranks_per_node, lambda node: node_answers(args.job, node)),
        previous_failure=_previous_failure(records, args.job, restart, args.relaunches),
        launch=launch,
    )


def _plan(
    situation: Situation, train_args: Sequence[str], output_dir: Path | None, say: Callable[[str], None]
) -> tuple[str, tuple[int | None, int | None]]:
    limits = read_limits(os.environ)
    progress = run_progress(output_dir, say) if output_dir is not None else (None, None)
    old_world = len(situation.step_nodes) * situation.ranks_per_node
    return decide(situation, limits, batch_holds(train_args, old_world), progress, say), progress


def _record_plan(output_dir: Path | None, situation: Situation, decision: str, progress) -> None:
    """The decision in the run's fault log, for the next failure's question "the same step again?"."""
    if output_dir is None:
        return
    lost = sorted(set(lost_nodes(situation.step_nodes, situation.job_nodes, situation.states)) | set(situation.named))
    record = {
        "kind": faults.PLAN,
        "launch": situation.launch,
        "failed_at": failed_at(situation, progress),
        "lost": lost,
        "decision": decision,
    }
    try:
        faults.append(fault_log(output_dir), record)
    except OSError:
        pass  # the decision stands; only the check for a repeated failure loses its memory


def relaunch_plan(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    """The answer to the batch script. When this module cannot read Slurm or the run, or fails itself, the answer
    is the safe one: a requeue (Slurm refuses it for a job that is not requeueable, which then ends), never the end
    of a job that could go on; on nodes that are all healthy, a run it cannot read ends the job as before (there is
    nothing lost to make up for, and no record to tell a repeated failure)."""
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        output_dir = output_dir_of(train_args)
        records = faults.read(fault_log(output_dir), say) if output_dir is not None else []
    except (ValueError, OSError) as error:
        output_dir, records, unreadable = None, [], error
    else:
        unreadable = None
    try:
        situation = _situation(args, records)
    except SlurmQueryError as error:
        say(f"cannot read Slurm's view of the job ({error}): requeueing the job, the safe choice")
        return "requeue"
    lost = lost_nodes(situation.step_nodes, situation.job_nodes, situation.states)
    if unreadable is not None and not lost and not situation.named:
        say(
            f"the training step failed on nodes that Slurm reports healthy, and the run cannot be read "
            f"({type(unreadable).__name__}: {one_line(unreadable)}): no relaunch, the job ends"
        )
        return "end"
    try:
        if unreadable is not None:
            raise unreadable
        decision, progress = _plan(situation, train_args, output_dir, say)
    except Exception as error:  # noqa: BLE001 -- whatever fails here, the job must not end for it
        if not isinstance(error, (ValueError, OSError, SlurmQueryError)):
            traceback.print_exc()
        if situation.requeueable:
            after = "requeueing the job, the safe choice (its next run resumes from the newest checkpoint)"
        else:
            after = "ending the job, which is not requeueable (the same command resumes from the newest checkpoint)"
        say(f"cannot plan a relaunch ({type(error).__name__}: {one_line(error)}): {after}")
        return "requeue" if situation.requeueable else "end"
    _record_plan(output_dir, situation, decision, progress)
    return decision


# ---- watching the step ------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_step(
    pid: int,
    path: Path,
    launch: str,
    say: Callable[[str], None],
    grace: float = STEP_END_GRACE_S,
    period: float = 0.5,
) -> bool:
    """Wait while the training step's srun (PID) runs. Once the ranks of LAUNCH have recorded a rank dead, stalled
    or out of contact (`txl_dist.world.faults`), srun may still wait for the dead node until Slurm marks it DOWN
    (SlurmdTimeout, 300 s by default): if it has not ended GRACE seconds later, end it (SIGKILL to srun, and
    ``scancel`` of the step's remains on the healthy nodes) so that the batch script decides now. True when it
    ended the step."""
    seen_at = None
    while _alive(pid):
        if seen_at is None:
            records = faults.of_launch(faults.read(path), launch, ("died", "stalled", "lost_contact"))
            if records:
                seen_at = time.monotonic()
                first = records[0]
        elif time.monotonic() - seen_at > grace:
            say(
                f"the ranks named {faults.describe(first)}; srun is still waiting for that rank's node "
                f"{grace:.0f} s later: ending the step now, not after Slurm's node timeout"
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            step = first.get("slurm_step")
            if isinstance(step, str) and re.fullmatch(r"[0-9]+\.[0-9]+", step):
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    subprocess.run(["scancel", "--quiet", step], capture_output=True, timeout=SCONTROL_TIMEOUT_S)
            return True
        time.sleep(period)
    return False


def _at_least(flag: str, text: str, least: int, most: int | None = None) -> int:
    if not re.fullmatch(r"\s*[0-9]+\s*", text) or int(text) < least or (most is not None and int(text) > most):
        allowed = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise ValueError(f"{flag} {text!r} is not allowed: a whole number {allowed}")
    return int(text)


def _launch_name(text: str) -> str:
    if not re.fullmatch(r"[0-9A-Za-z_]+\.[0-9]+\.[0-9]+", text):
        raise ValueError(f"--launch {text!r} is not allowed: JOB.RESTART.RELAUNCH, as the batch script names a step")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """``check``, ``relaunch`` or ``watch`` (the module docstring); exit 2 with one line for a bad variable or
    argument."""
    parser = argparse.ArgumentParser(prog="python -m txl_dist.world.slurm_nodes")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help=f"validate {MIN_NODES_VAR}, {MAX_RELAUNCHES_VAR}, {SPARE_NODES_VAR} and {RANKS_PER_NODE_VAR}"
    )
    check.add_argument("--nodes", default=None, help="the job's node count")
    relaunch = commands.add_parser("relaunch", help="what to do after a failed training step")
    relaunch.add_argument("--job", required=True)
    relaunch.add_argument("--step-nodes", required=True, help="the Slurm host list of the step that ended")
    relaunch.add_argument("--ranks-per-node", required=True)
    relaunch.add_argument("--relaunches", required=True, help="relaunches in this run of the job so far")
    relaunch.add_argument("--spares", default="-", help="the idle nodes kept to replace a lost one ('-': none)")
    relaunch.add_argument("--status", default=None, help="the exit status of the step that ended")
    relaunch.add_argument("--launch", default=None, help=f"the step's {faults.LAUNCH_VAR} (JOB.RESTART.RELAUNCH)")
    relaunch.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py's arguments, after --")
    watch = commands.add_parser("watch", help="end a step whose ranks named a lost rank without waiting for Slurm")
    watch.add_argument("--step-pid", required=True, help="the PID of the step's srun")
    watch.add_argument("--launch", required=True, help=f"the step's {faults.LAUNCH_VAR}")
    watch.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py's arguments, after --")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"slurm.sbatch: {line}", file=sys.stderr, flush=True)

    try:
        if args.command == "check":
            read_limits(os.environ, None if args.nodes is None else _at_least("--nodes", args.nodes, 1))
            return 0
        train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        if args.command == "watch":
            pid, launch = _at_least("--step-pid", args.step_pid, 1), _launch_name(args.launch)
            output_dir = output_dir_of(train_args)
            if output_dir is not None:
                watch_step(pid, fault_log(output_dir), launch, say)
            return 0
        args.ranks_per_node = _at_least("--ranks-per-node", args.ranks_per_node, 1, MOST_RANKS_PER_NODE)
        args.relaunches = _at_least("--relaunches", args.relaunches, 0)
        args.status = None if args.status in (None, "") else _at_least("--status", args.status, 0)
        args.launch = None if args.launch is None else _launch_name(args.launch)
        decision = relaunch_plan(args, say)
    except ValueError as error:
        print(f"slurm.sbatch: error: {one_line(error)}", file=sys.stderr)
        return 2
    print(decision, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "slurm.sbatch"))
