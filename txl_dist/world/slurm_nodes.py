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
size and the steps that the relaunch recomputes. ``python -m txl_dist.world.slurm_nodes check`` validates the two
variables at the start of the job (exit 2 with one line naming the variable).

A node counts as lost when Slurm has taken it out of the job (``--no-kill`` jobs keep running without a failed
node, whose ``NodeList`` no longer names it) or its state keeps jobs off it (DOWN, DRAIN, FAIL, NOT_RESPONDING,
...). srun ends a step that had a task on a dead node only once Slurm has marked the node DOWN (SlurmdTimeout), so
by then Slurm's view is settled. A rank that fails on a node Slurm still calls healthy (a bad file, the OOM
killer) is not a lost node: the job ends as before, since the same fault would most likely end the relaunch too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from txl_dist.checkpoints.layout import complete_tags, step_of_tag
from txl_dist.config import load_config
from txl_dist.config.files import read_layers
from txl_dist.exit_status import run_command
from txl_dist.run_layout import METRICS, checkpoints_dir

MIN_NODES_VAR = "TXL_MIN_NODES"
MAX_RELAUNCHES_VAR = "TXL_MAX_RELAUNCHES"
DEFAULT_MIN_NODES = 1
DEFAULT_MAX_RELAUNCHES = 3
"""Relaunches per run of a job: a node lost every few days costs one; a fourth within one allocation means the
nodes left are suspect too, and the queue (with its fresh nodes) is the better place to wait."""

_UNUSABLE = re.compile(r"DOWN|DRAIN|FAIL|NOT_RESPONDING|NO_RESPOND|POWER|REBOOT|UNKNOWN|FUTURE|\*")
"""Words of a node state (``scontrol show node``'s State=, sinfo's %T) that keep new job steps off the node."""

SCONTROL_TIMEOUT_S = 60.0


class SlurmQueryError(RuntimeError):
    """scontrol failed or answered something this module cannot read; the message names the command."""


@dataclass(frozen=True)
class Limits:
    """The job's relaunch limits, from the environment of the batch script."""

    min_nodes: int = DEFAULT_MIN_NODES
    max_relaunches: int = DEFAULT_MAX_RELAUNCHES


def _whole(environ: Mapping[str, str], name: str, default: int, least: int) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    if not re.fullmatch(r"[0-9]+", text) or int(text) < least:
        raise ValueError(f"{name}={text!r} is not allowed: a whole number of at least {least}")
    return int(text)


def read_limits(environ: Mapping[str, str] = os.environ, job_nodes: int | None = None) -> Limits:
    """TXL_MIN_NODES (default 1, at least 1, at most JOB_NODES when given) and TXL_MAX_RELAUNCHES (default 3, at
    least 0); ValueError naming the variable and its value."""
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


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol show -o`` record as a dict (values may contain spaces, as Reason= does)."""
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    return {
        match.group(1): line[match.end() : matches[i + 1].start() if i + 1 < len(matches) else len(line)].strip()
        for i, match in enumerate(matches)
    }


def hostnames(nodelist: str) -> list[str]:
    """A Slurm host list (``node[1-3],gpu7``) as names, in Slurm's order; [] for an empty or (null) list."""
    if nodelist.strip() in ("", "(null)"):
        return []
    return _scontrol("show", "hostnames", nodelist).split()


def usable(state: str) -> bool:
    """Whether a node in STATE (``IDLE``, ``MIXED+DRAIN``, ``DOWN+NOT_RESPONDING``, ``idle*``) takes job steps."""
    return bool(state) and not _UNUSABLE.search(state.upper())


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
    """``scontrol show job -o JOB`` as a dict (NodeList, Requeue, Restarts, ...)."""
    lines = _scontrol("show", "job", "-o", job_id).splitlines()
    if not lines:
        raise SlurmQueryError(f"scontrol show job -o {job_id} printed nothing")
    return parse_record(lines[0])


def lost_nodes(step_nodes: Sequence[str], job_nodes: Sequence[str], states: Mapping[str, str]) -> dict[str, str]:
    """The nodes of the step that the next step cannot use, each with why (in Slurm's words)."""
    lost = {}
    for node in step_nodes:
        if node not in job_nodes:
            lost[node] = f"removed from the job by Slurm, State={states.get(node, 'unknown')}"
        elif not usable(states.get(node, "")):
            lost[node] = f"State={states.get(node, 'unknown to Slurm')}"
    return lost


# ---- the run's side -------------------------------------------------------------------------------------------


def run_progress(output_dir: Path) -> tuple[int | None, int | None]:
    """(the newest step in metrics.jsonl, the newest checkpoint step with a completion marker) of a run.

    The trainer verifies the checkpoint before it trusts it and falls back to an older one, so the second number
    is where the relaunch resumes when that checkpoint is whole, which it is unless the disk damaged it."""
    logged = None
    try:
        with open(output_dir / METRICS, encoding="utf-8") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the line a dying rank was writing
                    continue
                if record.get("kind") == "train":
                    logged = max(logged or 0, int(record["step"]))
    except OSError:
        pass
    checkpointed = None
    tags = complete_tags(checkpoints_dir(output_dir))
    if tags:
        checkpointed = step_of_tag(tags[-1])
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
    redo = (logged or 0) - (checkpointed or 0)
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
    job_nodes = hostnames(job.get("NodeList", ""))
    return Situation(
        step_nodes=step_nodes,
        job_nodes=job_nodes,
        states=node_states(step_nodes),
        batch_host=job.get("BatchHost", ""),
        ranks_per_node=args.ranks_per_node,
        relaunches=args.relaunches,
        requeueable=job.get("Requeue") == "1",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``check`` or ``relaunch`` (the module docstring); exit 2 with one line for a bad variable or argument."""
    parser = argparse.ArgumentParser(prog="python -m txl_dist.world.slurm_nodes")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help=f"validate {MIN_NODES_VAR} and {MAX_RELAUNCHES_VAR}")
    check.add_argument("--nodes", type=int, default=None, help="the job's node count")
    relaunch = commands.add_parser("relaunch", help="what to do after a failed training step")
    relaunch.add_argument("--job", required=True)
    relaunch.add_argument("--step-nodes", required=True, help="the Slurm host list of the step that ended")
    relaunch.add_argument("--ranks-per-node", type=int, required=True)
    relaunch.add_argument("--relaunches", type=int, required=True, help="relaunches in this run of the job so far")
    relaunch.add_argument("train_args", nargs=argparse.REMAINDER, help="train.py's arguments, after --")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"slurm.sbatch: {line}", file=sys.stderr, flush=True)

    try:
        if args.command == "check":
            read_limits(os.environ, args.nodes)
            return 0
        limits = read_limits(os.environ)
        train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        situation = _situation(args)
        output_dir = output_dir_of(train_args)
        progress = run_progress(output_dir) if output_dir is not None else (None, None)
        old_world = len(situation.step_nodes) * situation.ranks_per_node
        decision = decide(situation, limits, batch_holds(train_args, old_world), progress, say)
    except ValueError as error:
        print(f"slurm.sbatch: error: {error}", file=sys.stderr)
        return 2
    except SlurmQueryError as error:
        say(f"cannot read Slurm's view of the job ({error}): no relaunch")
        decision = "end"
    print(decision, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "slurm.sbatch"))
