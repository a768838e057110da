"""The decision of ``launchers/slurm.sbatch`` after a failed training step: relaunch on which nodes, requeue the
job, or end it (docs/recovery.md). `relaunch_plan` reads Slurm's view (`txl_dist.supervision.slurm_view`), the run
(`txl_dist.supervision.run_progress`) and the ranks' fault records (`txl_dist.supervision.faults`); `decide` is the
rule, on those facts alone.
"""

from __future__ import annotations

import argparse
import os
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from txl_dist.exit_status import NUMERICAL_FAULT, USAGE_ERROR, one_line
from txl_dist.run_paths import fault_log
from txl_dist.supervision import faults
from txl_dist.supervision.run_progress import global_batch_fits, output_dir_of, run_progress
from txl_dist.supervision.slurm_view import (
    SlurmQueryError,
    describe_state,
    hostnames,
    job_record,
    lost_nodes,
    named_by_the_ranks,
    node_answers,
    node_states,
    usable,
)

MIN_NODES_VAR = "TXL_MIN_NODES"
MAX_RELAUNCHES_VAR = "TXL_MAX_RELAUNCHES"
RANKS_PER_NODE_VAR = "TXL_RANKS_PER_NODE"
SPARE_NODES_VAR = "TXL_SPARE_NODES"
MOST_RANKS_PER_NODE = 4096
"""The bound of TXL_RANKS_PER_NODE: far above any node's devices, and far below what the batch script's arithmetic
fits."""
DEFAULT_MIN_NODES = 1
DEFAULT_MAX_RELAUNCHES = 3
"""Relaunches per run of a job: a node lost every few days costs one; a fourth within one allocation means the
nodes left are suspect too, and the queue (with its fresh nodes) is the better place to wait."""
SAME_STEP_SLACK = 1
"""Steps by which two failures may differ and still be "the same step": the ranks that name a dead one may stand one
step apart (each waits in the next step's all-reduce), so a fault that kills a rank at step S is recorded at S or
S + 1 by whichever rank reports it."""


@dataclass(frozen=True)
class Limits:
    """The job's relaunch limits, from the environment of the batch script."""

    min_nodes: int = DEFAULT_MIN_NODES
    max_relaunches: int = DEFAULT_MAX_RELAUNCHES
    spare_nodes: int = 0


def _whole_number(environ: Mapping[str, str], name: str, default: int, least: int, most: int | None = None) -> int:
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
    _whole_number(environ, RANKS_PER_NODE_VAR, 1, 1, MOST_RANKS_PER_NODE)
    limits = Limits(
        _whole_number(environ, MIN_NODES_VAR, DEFAULT_MIN_NODES, 1),
        _whole_number(environ, MAX_RELAUNCHES_VAR, DEFAULT_MAX_RELAUNCHES, 0),
        _whole_number(environ, SPARE_NODES_VAR, 0, 0),
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


def largest_world(
    healthy: int, ranks_per_node: int, min_nodes: int, fits: Callable[[int], bool]
) -> tuple[int | None, list[int]]:
    """The most nodes (at most HEALTHY, at least MIN_NODES) whose ranks hold the global batch (FITS(world)), and
    the node counts that were refused; None when no count does."""
    refused = []
    for nodes in range(healthy, min_nodes - 1, -1):
        if fits(nodes * ranks_per_node):
            return nodes, refused
        refused.append(nodes)
    return None, refused


@dataclass(frozen=True)
class Situation:
    """What the decision reads: the step that ended, Slurm's view of the job after it, and what the ranks
    recorded (`txl_dist.supervision.faults`)."""

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
    """The failed step's name in the fault log (`txl_dist.supervision.faults.launch_id`)."""


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
    situation: Situation, limits: Limits, progress: tuple[int | None, int | None], explain: Callable[[str], None]
) -> str:
    """The decision after a step failed on nodes that are all healthy (Slurm's view and the ranks' agree): the
    same nodes again, so the world and the run are those of the uninterrupted run, unless the failure came back at
    the same step after a relaunch, or the relaunches are used up; then the job ends (a failure on healthy nodes is
    not one that the queue cures). A refused input or a numerical stop never comes here (`never_retried`)."""
    what = faults.describe(situation.failures[0]) if situation.failures else "no rank recorded why"
    nodes = ", ".join(f"{node} {situation.states.get(node, '?')}" for node in situation.step_nodes)
    step = failed_at(situation, progress)
    previous = situation.previous_failure
    if step is not None and previous is not None and abs(step - previous) <= SAME_STEP_SLACK:
        explain(
            f"the failure came back at step {step} after a relaunch ({what}): not retrying it again, the job ends; "
            f"the same command resumes from the newest checkpoint once the cause is fixed"
        )
        return "end"
    if situation.relaunches >= limits.max_relaunches:
        explain(
            f"the training step failed on healthy nodes ({what}) after {situation.relaunches} relaunch(es) in this "
            f"job, {MAX_RELAUNCHES_VAR}={limits.max_relaunches}: the job ends"
        )
        return "end"
    at, since, redo = _progress_words(progress)
    world = len(situation.step_nodes) * situation.ranks_per_node
    explain(
        f"the training step failed {at} on nodes that are healthy ({nodes}): {what}; relaunch "
        f"{situation.relaunches + 1} of {limits.max_relaunches} ({MAX_RELAUNCHES_VAR}) on the same nodes: world "
        f"{world} as before; resuming from {since}, {redo} step(s) recomputed"
    )
    return _relaunch_line(situation.step_nodes, situation.spares)


def never_retried(situation: Situation) -> str | None:
    """Why the failure is one that no relaunch cures, whatever the nodes (a refused input, a run stopped by its own
    numbers), None otherwise."""
    kinds = {record.get("kind") for record in situation.failures} & faults.NEVER_RETRIED_KINDS
    what = faults.describe(situation.failures[0]) if situation.failures else "no rank recorded why"
    if "refused" in kinds or situation.status == USAGE_ERROR:
        return f"a rank refused its input ({what}): a relaunch would be refused the same way, so the job ends"
    if "numerics" in kinds or situation.status == NUMERICAL_FAULT:
        return (
            f"the run stopped on its own numbers ({what}): a relaunch would meet the same fault, so the job ends; "
            "the newest healthy checkpoint is kept"
        )
    return None


def _relaunch_line(nodes: Sequence[str], spares: Sequence[str]) -> str:
    return f"relaunch {len(nodes)} {','.join(nodes)} {','.join(spares) or '-'}"


def take_spares(
    situation: Situation, lost: Mapping[str, str], explain: Callable[[str], None]
) -> tuple[list[str], list[str]]:
    """The nodes of the next step: the step's healthy nodes, each lost one replaced by a usable spare in its place
    while spares last; and the spares left. A spare that Slurm took out of the job or marks unusable is dropped."""
    spares = []
    for node in situation.spares:
        if node not in situation.job_nodes or not usable(situation.states.get(node, "")):
            state = situation.states.get(node)
            why = "removed from the job" if node not in situation.job_nodes else describe_state(state)
            explain(f"spare {node} is not usable ({why}): dropped")
        else:
            spares.append(node)
    nodes = []
    for node in situation.step_nodes:
        if node not in lost:
            nodes.append(node)
        elif spares:
            spare = spares.pop(0)
            explain(f"spare {spare} takes the place of {node}: the world keeps its size")
            nodes.append(spare)
    return nodes, spares


def decide(
    situation: Situation,
    limits: Limits,
    fits: Callable[[int], bool],
    progress: tuple[int | None, int | None],
    explain: Callable[[str], None],
) -> str:
    """The line for the batch script (``relaunch N NODES SPARES``, ``requeue`` or ``end``); EXPLAIN gets the reasons."""
    why = never_retried(situation)
    if why is not None:  # checked before the nodes: a node lost beside such a failure does not make it curable
        explain(why)
        return "end"
    lost = lost_nodes(situation.step_nodes, situation.job_nodes, situation.states)
    for node, why in situation.named.items():
        lost.setdefault(node, why)
    if not lost:
        return retry_on_the_same_nodes(situation, limits, progress, explain)
    at, since, redo = _progress_words(progress)
    explain(f"lost {', '.join(f'{node} ({why})' for node, why in lost.items())} {at}; newest checkpoint: {since}")
    give_up, after = _give_up(situation, since)
    if situation.relaunches >= limits.max_relaunches:
        explain(
            f"{situation.relaunches} relaunch(es) in this job already, "
            f"{MAX_RELAUNCHES_VAR}={limits.max_relaunches}: {after}"
        )
        return give_up
    healthy, spares = take_spares(situation, lost, explain)
    healthy.sort(key=lambda node: node != situation.batch_host)  # the batch host is alive: keep it, as rank 0
    if len(healthy) < limits.min_nodes:
        explain(f"{len(healthy)} node(s) left, fewer than {MIN_NODES_VAR}={limits.min_nodes}: {after}")
        return give_up
    nodes, refused = largest_world(len(healthy), situation.ranks_per_node, limits.min_nodes, fits)
    if nodes is None:
        worlds = ", ".join(str(count * situation.ranks_per_node) for count in refused)
        explain(
            f"the global batch does not split over {worlds} rank(s) (train.global_batch, train.micro_batch): {after}"
        )
        return give_up
    if refused:
        counts = ", ".join(str(count) for count in refused)
        explain(f"{counts} node(s) would not hold the global batch; using {nodes} of the {len(healthy)} left")
    chosen = healthy[:nodes]
    old_world = len(situation.step_nodes) * situation.ranks_per_node
    new_world = nodes * situation.ranks_per_node
    batch = "the same micro-batches" if new_world == old_world else "the same global batch"
    explain(
        f"relaunch {situation.relaunches + 1} of {limits.max_relaunches} ({MAX_RELAUNCHES_VAR}) on "
        f"{','.join(chosen)}: world {old_world} -> {new_world} rank(s), {batch}; resuming from {since}, {redo} "
        "step(s) recomputed"
    )
    return _relaunch_line(chosen, spares)


def _previous_failure(
    records: Sequence[Mapping], job: str, restart: str, relaunches: int, explain: Callable[[str], None]
) -> int | None:
    """The step at which the previous training step of this run of the job failed on healthy nodes (its plan
    record), None when there was none (EXPLAIN names a record whose step is damaged)."""
    if relaunches == 0:
        return None
    previous = faults.launch_id(job, restart, relaunches - 1)
    for record in reversed(records):
        if record.get("kind") == faults.PLAN and record.get("launch") == previous and not record.get("lost"):
            step = faults.whole(record.get("failed_at"))
            if step is None and record.get("failed_at") is not None:
                explain(
                    f"warning: the plan record of step {previous} gives failed_at {record.get('failed_at')!r}, no "
                    "step number: whether the failure came back at the same step cannot be told"
                )
            return step
    return None


def _situation(args: argparse.Namespace, records: Sequence[Mapping], explain: Callable[[str], None]) -> Situation:
    job = job_record(args.job)
    step_nodes = hostnames(args.step_nodes)
    repeated = sorted({node for node in step_nodes if step_nodes.count(node) > 1})
    if repeated:
        raise ValueError(f"--step-nodes {args.step_nodes!r} names {', '.join(repeated)} more than once")
    spares = hostnames(args.spares) if args.spares != "-" else []
    repeated = sorted({node for node in spares if spares.count(node) > 1})
    if repeated:
        raise ValueError(f"--spares {args.spares!r} names {', '.join(repeated)} more than once")
    spares = [node for node in spares if node not in step_nodes]
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
        previous_failure=_previous_failure(records, args.job, restart, args.relaunches, explain),
        launch=launch,
    )


def _plan(
    situation: Situation, train_args: Sequence[str], output_dir: Path | None, explain: Callable[[str], None]
) -> tuple[str, tuple[int | None, int | None]]:
    limits = read_limits(os.environ)
    progress = run_progress(output_dir, explain) if output_dir is not None else (None, None)
    old_world = len(situation.step_nodes) * situation.ranks_per_node
    return decide(situation, limits, global_batch_fits(train_args, old_world), progress, explain), progress


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


def relaunch_plan(args: argparse.Namespace, explain: Callable[[str], None]) -> str:
    """The answer to the batch script. When this module cannot read Slurm or the run, or fails itself, the answer
    is the safe one: a requeue (Slurm refuses it for a job that is not requeueable, which then ends), never the end
    of a job that could go on; on nodes that are all healthy, a run it cannot read ends the job as before (there is
    nothing lost to make up for, and no record to tell a repeated failure)."""
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        output_dir = output_dir_of(train_args)
        records = faults.read(fault_log(output_dir), explain) if output_dir is not None else []
    except (ValueError, OSError) as error:
        output_dir, records, unreadable = None, [], error
    else:
        unreadable = None
    try:
        situation = _situation(args, records, explain)
    except SlurmQueryError as error:
        explain(f"cannot read Slurm's view of the job ({error}): requeueing the job, the safe choice")
        return "requeue"
    lost = lost_nodes(situation.step_nodes, situation.job_nodes, situation.states)
    if unreadable is not None and not lost and not situation.named:
        explain(
            f"the training step failed on nodes that Slurm reports healthy, and the run cannot be read "
            f"({type(unreadable).__name__}: {one_line(unreadable)}): no relaunch, the job ends"
        )
        return "end"
    try:
        if unreadable is not None:
            raise unreadable
        decision, progress = _plan(situation, train_args, output_dir, explain)
    except Exception as error:  # noqa: BLE001 -- whatever fails here, the job must not end for it
        if not isinstance(error, (ValueError, OSError, SlurmQueryError)):
            traceback.print_exc()
        if situation.requeueable:
            after = "requeueing the job, the safe choice (its next run resumes from the newest checkpoint)"
        else:
            after = "ending the job, which is not requeueable (the same command resumes from the newest checkpoint)"
        explain(f"cannot plan a relaunch ({type(error).__name__}: {one_line(error)}): {after}")
        return "requeue" if situation.requeueable else "end"
    _record_plan(output_dir, situation, decision, progress)
    return decision
