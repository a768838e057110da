"""Slurm's view of a job's nodes, and the relaunch decision of ``launchers/slurm.sbatch`` (README.md, "Elastic
runs").

The batch script decides every restart of a Slurm job; this module is the part of it that reads Slurm and the
run. When the training step ends non-zero without a stop request, the script asks::

    python -m txl_dist.world.slurm_nodes relaunch --job JOB --step-nodes NODES --ranks-per-node R --relaunches K \\
        -- TRAIN_ARGS...

which prints one line on stdout: ``relaunch N NODELIST`` (start the step again on those N nodes), ``requeue`` (a
node was lost but the job cannot go on: below ``TXL_MIN_NODES``, past ``TXL_MAX_RELAUNCHES``, or no smaller world
holds the global batch; the job is requeueable, so it goes back to the queue as a node failure did before) or
``end`` (no node was lost, or the job is not requeueable: the job ends with the step's status). Its reasons go to
stderr, the job's log, in one line each: which node was lost and how Slurm sees it, at which step, the new world
size and the steps that the relaunch recomputes. Where this module cannot read Slurm's view (a failed, blank or
foreign ``scontrol`` answer) or the run (a config file gone), or fails itself, it answers the safe verdict:
``requeue`` (``end`` for a job known not to be requeueable), never the end of a job that could go on; a damaged
line of metrics.jsonl is skipped with a warning naming the file and the line. ``python -m
txl_dist.world.slurm_nodes check`` validates the batch script's variables at the start of the job (exit 2 with one
line naming the variable).

A node counts as lost when Slurm has taken it out of the job (``--no-kill`` jobs keep running without a failed node,
whose ``NodeList`` no longer names it) or its state is not one that Slurm documents as usable (IDLE, MIXED,
ALLOCATED, COMPLETING, with flags that keep steps running: `usable`); DOWN, DRAIN, FAIL, NOT_RESPONDING, INVAL, no
state at all, ... keep it out. srun ends a step that had a task on a dead node only once Slurm has marked the node
DOWN (SlurmdTimeout), so by then Slurm's view is settled. A rank that fails on a node Slurm still calls healthy (a
bad file, the OOM killer) is not a lost node: the job ends as before, since the same fault would most likely end the
relaunch too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from txl_dist.checkpoints.layout import complete_tags, step_of_tag
from txl_dist.config import load_config
from txl_dist.config.files import read_layers
from txl_dist.exit_status import one_line, run_command
from txl_dist.run_layout import METRICS, checkpoints_dir

MIN_NODES_VAR = "TXL_MIN_NODES"
MAX_RELAUNCHES_VAR = "TXL_MAX_RELAUNCHES"
RANKS_PER_NODE_VAR = "TXL_RANKS_PER_NODE"
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


class SlurmQueryError(RuntimeError):
    """scontrol failed or answered something this module cannot read; the message names the command."""


class RunLogError(ValueError):
    """A line of metrics.jsonl that is not a train record this module can read; the message says why."""


@dataclass(frozen=True)
class Limits:
    """The job's relaunch limits, from the environment of the batch script."""

    min_nodes: int = DEFAULT_MIN_NODES
    max_relaunches: int = DEFAULT_MAX_RELAUNCHES


def _whole(environ: Mapping[str, str], name: str, default: int, least: int, most: int | None = None) -> int:
    text = environ.get(name, "").strip(" \t\n\r\f\v")  # the blanks that the batch script strips too
    if not text:
        return default
    if not re.fullmatch(r"[0-9]+", text) or int(text) < least or (most is not None and int(text) > most):
        allowed = f"from {least} to {most}" if most is not None else f"of at least {least}"
        raise ValueError(f"{name}={text!r} is not allowed: a whole number {allowed}")
    return int(text)


def read_limits(environ: Mapping[str, str] = os.environ, job_nodes: int | None = None) -> Limits:
    """TXL_MIN_NODES (default 1, at least 1, at most JOB_NODES when given) and TXL_MAX_RELAUNCHES (default 3, at
    least 0); ValueError naming the variable and its value. TXL_RANKS_PER_NODE, read by the batch script alone, is
    checked here too (unset, or at least 1), so that every variable of the script is refused in one place."""
    _whole(environ, RANKS_PER_NODE_VAR, 1, 1, MOST_RANKS_PER_NODE)
    limits = Limits(
        _whole(environ, MIN_NODES_VAR, DEFAULT_MIN_NODES, 1),
        _whole(environ, MAX_RELAUNCHES_VAR, DEFAULT_MAX_RELAUNCHES, 0),
    )
    if job_nodes is not None and limits.min_nodes > job_nodes:
        raise ValueError(
            f"{MIN_NODES_VAR}={limits.min_nodes} is more than the job's {job_nodes} node(s): the job could never "
            "start; allowed: 1 to the number of nodes"
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


# ---- the decision -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Situation:
    """What the decision reads: the step that ended and Slurm's view of the job after it."""

    step_nodes: list[str]
    job_nodes: list[str]
    states: dict[str, str]
    batch_host: str
    ranks_per_node: int
    relaunches: int
    requeueable: bool


def decide(
    situation: Situation,
    limits: Limits,
    holds: Callable[[int], bool],
    progress: tuple[int | None, int | None],
    say: Callable[[str], None],
) -> str:
    """The line for the batch script (``relaunch N NODES``, ``requeue`` or ``end``); SAY gets the reasons."""
    lost = lost_nodes(situation.step_nodes, situation.job_nodes, situation.states)
    if not lost:
        say(
            "the training step failed on nodes that Slurm reports healthy ("
            + ", ".join(f"{node} {situation.states.get(node, '?')}" for node in situation.step_nodes)
            + "): not a lost node, so no relaunch"
        )
        return "end"
    logged, checkpointed = progress
    at = f"at step {logged}" if logged is not None else "before its first logged step"
    since = f"checkpoint step {checkpointed}" if checkpointed is not None else "the start (no checkpoint yet)"
    redo = max(0, (logged or 0) - (checkpointed or 0))
    say(f"lost {', '.join(f'{node} ({why})' for node, why in lost.items())} {at}; newest checkpoint: {since}")
    healthy = [node for node in situation.step_nodes if node not in lost]
    healthy.sort(key=lambda node: node != situation.batch_host)  # the batch host is alive: keep it, as rank 0
    give_up = "requeue" if situation.requeueable else "end"
    if situation.requeueable:
        after = f"requeueing the job (its next run resumes from {since})"
    else:
        after = f"ending the job (the same command resumes from {since})"
    if len(healthy) < limits.min_nodes:
        say(f"{len(healthy)} node(s) left, fewer than {MIN_NODES_VAR}={limits.min_nodes}: {after}")
        return give_up
    if situation.relaunches >= limits.max_relaunches:
        say(
            f"{situation.relaunches} relaunch(es) in this job already, "
            f"{MAX_RELAUNCHES_VAR}={limits.max_relaunches}: {after}"
        )
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
    say(
        f"relaunch {situation.relaunches + 1} of {limits.max_relaunches} ({MAX_RELAUNCHES_VAR}) on "
        f"{','.join(chosen)}: world {old_world} -> {nodes * situation.ranks_per_node} rank(s), the same global "
        f"batch; resuming from {since}, {redo} step(s) recomputed"
    )
    return f"relaunch {nodes} {','.join(chosen)}"


def _situation(args: argparse.Namespace) -> Situation:
    job = job_record(args.job)
    step_nodes = hostnames(args.step_nodes)
    repeated = sorted({node for node in step_nodes if step_nodes.count(node) > 1})
    if repeated:
        raise ValueError(f"--step-nodes {args.step_nodes!r} names {', '.join(repeated)} more than once")
    return Situation(
        step_nodes=step_nodes,
        job_nodes=hostnames(job["NodeList"]),
        states=node_states(step_nodes),
        batch_host=job.get("BatchHost", ""),
        ranks_per_node=args.ranks_per_node,
        relaunches=args.relaunches,
        requeueable=job.get("Requeue") == "1",
    )


def _plan(situation: Situation, train_args: Sequence[str], say: Callable[[str], None]) -> str:
    """`decide` on the run's side read only when a node was lost: a run this module cannot read does not turn a
    failure on healthy nodes into a requeue."""
    limits = read_limits(os.environ)
    progress: tuple[int | None, int | None] = (None, None)
    if lost_nodes(situation.step_nodes, situation.job_nodes, situation.states):
        output_dir = output_dir_of(train_args)
        progress = run_progress(output_dir, say) if output_dir is not None else (None, None)
    old_world = len(situation.step_nodes) * situation.ranks_per_node
    return decide(situation, limits, batch_holds(train_args, old_world), progress, say)


def relaunch_plan(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    """The answer to the batch script. When this module cannot read Slurm or the run, or fails itself, the answer
    is the safe one: a requeue (Slurm refuses it for a job that is not requeueable, which then ends), never the end
    of a job that could go on."""
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        situation = _situation(args)
    except SlurmQueryError as error:
        say(f"cannot read Slurm's view of the job ({error}): requeueing the job, the safe choice")
        return "requeue"
    try:
        return _plan(situation, train_args, say)
    except Exception as error:  # noqa: BLE001 -- whatever fails here, the job must not end for it
        if not isinstance(error, (ValueError, OSError, SlurmQueryError)):
            traceback.print_exc()
        if situation.requeueable:
            after = "requeueing the job, the safe choice (its next run resumes from the newest checkpoint)"
        else:
            after = "ending the job, which is not requeueable (the same command resumes from the newest checkpoint)"
        say(f"cannot plan a relaunch ({type(error).__name__}: {one_line(error)}): {after}")
        return "requeue" if situation.requeueable else "end"


def _at_least(flag: str, text: str, least: int) -> int:
    if not re.fullmatch(r"\s*[0-9]+\s*", text) or int(text) < least:
        raise ValueError(f"{flag} {text!r} is not allowed: a whole number of at least {least}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    """``check`` or ``relaunch`` (the module docstring); exit 2 with one line for a bad variable or argument."""
    parser = argparse.ArgumentParser(prog="python -m txl_dist.world.slurm_nodes")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help=f"validate {MIN_NODES_VAR}, {MAX_RELAUNCHES_VAR} and {RANKS_PER_NODE_VAR}"
    )
    check.add_argument("--nodes", default=None, help="the job's node count")
    relaunch = commands.add_parser("relaunch", help="what to do after a failed training step")
    relaunch.add_argument("--job", required=True)
    relaunch.add_argument("--step-nodes", required=True, help="the Slurm host list of the step that ended")
    relaunch.add_argument("--ranks-per-node", required=True)
    relaunch.add_argument("--relaunches", required=True, help="relaunches in this run of the job so far")
    relaunch.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py's arguments, after --")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"slurm.sbatch: {line}", file=sys.stderr, flush=True)

    try:
        if args.command == "check":
            read_limits(os.environ, None if args.nodes is None else _at_least("--nodes", args.nodes, 1))
            return 0
        args.ranks_per_node = _at_least("--ranks-per-node", args.ranks_per_node, 1)
        args.relaunches = _at_least("--relaunches", args.relaunches, 0)
        decision = relaunch_plan(args, say)
    except ValueError as error:
        print(f"slurm.sbatch: error: {one_line(error)}", file=sys.stderr)
        return 2
    print(decision, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "slurm.sbatch"))
