"""The command of ``launchers/slurm.sbatch`` that reads Slurm and the run: ``check``, ``relaunch`` (the decision of
`txl_dist.supervision.relaunch`) and ``watch`` (docs/clusters.md, Elastic runs; docs/recovery.md).

The batch script decides every restart of a Slurm job; this module is the part of it that reads Slurm and the
run. When the training step ends non-zero without a stop request, the script asks::

    python -m txl_dist.supervision.slurm_nodes relaunch --job JOB --step-nodes NODES --ranks-per-node R \\
        --relaunches K --spares SPARES --status STATUS --launch JOB.RESTART.K -- TRAIN_ARGS...

which prints one line on stdout: ``relaunch N NODELIST SPARES`` (start the step again on those N nodes, keeping
SPARES, ``-`` for none, idle), ``requeue`` (a node was lost but the job cannot go on: below ``TXL_MIN_NODES``, past
``TXL_MAX_RELAUNCHES``, or no smaller world fits the global batch; the job is requeueable, so it goes back to the
queue as a node failure did before) or ``end`` (the job ends with the step's status). Its reasons go to stderr, the
job's log, in one line each.

What it reads:

- Slurm: a node counts as lost when Slurm has taken it out of the job (``--no-kill`` jobs keep running without a
  failed node, whose ``NodeList`` no longer names it) or its state is not one that Slurm documents as usable (IDLE,
  MIXED, ALLOCATED, COMPLETING, with flags that keep steps running: `usable`); DOWN, DRAIN, FAIL, NOT_RESPONDING,
  INVAL, no state at all, ... keep it out.
- The ranks (the run's fault log, `txl_dist.supervision.faults`): Slurm notices a dead node only after SlurmdTimeout
  (300 s by default); the ranks name a dead or stalled rank within seconds. The host of a stalled rank is left out
  at once; the host of a rank that died is left out when Slurm cannot run a one-task step there (`node_answers`),
  and is a healthy node otherwise. ``python -m txl_dist.supervision.slurm_nodes watch`` ends a step whose ranks named a
  lost rank while srun still waits for that node, so that this decision comes at once.

What it decides: with a node lost, a spare (``TXL_SPARE_NODES``) takes its place, so the world keeps its size;
without spares the step goes on the nodes left. With every node healthy (a rank killed by the OOM killer, a
crash), the step starts again on the same nodes, unless a rank refused its input (exit 2, a ``refused`` record),
or the failure came back at the same step after a relaunch (the script's own ``plan`` records in the fault log),
or the relaunches are used up: then the job ends, with one line naming the step, the rank and its last error line.
Where this module cannot read Slurm's view (a failed, blank or foreign ``scontrol`` answer) or the run (a config
file gone), or fails itself, it answers the safe verdict: ``requeue`` (``end`` for a job known not to be
requeueable), never the end of a job that could go on; a damaged line of metrics.jsonl or of the fault log is
skipped with a warning naming the file and the line. ``python -m txl_dist.supervision.slurm_nodes check``
validates the batch script's variables at the start of the job (exit 2 with one line naming the variable) and,
with ``--nodelist``, prints the job's nodes one a line, read by the one parser of Slurm host lists
(`txl_dist.rendezvous.launch_formats.expand_hostlist`, as the relaunch decision reads NodeList).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from txl_dist.exit_status import one_line, run_command
from txl_dist.rendezvous.launch_formats import expand_hostlist
from txl_dist.run_paths import fault_log
from txl_dist.supervision import faults
from txl_dist.supervision.relaunch import (
    MAX_RELAUNCHES_VAR,
    MIN_NODES_VAR,
    MOST_RANKS_PER_NODE,
    RANKS_PER_NODE_VAR,
    SPARE_NODES_VAR,
    read_limits,
    relaunch_plan,
)
from txl_dist.supervision.run_progress import output_dir_of
from txl_dist.supervision.slurm_view import SCONTROL_TIMEOUT_S

STEP_END_GRACE_S = 10.0
"""`watch`: after the ranks named a rank dead or stalled, how long srun may take to end by itself before the batch
script stops waiting for it (the ranks on healthy nodes end within a few seconds of the report; srun itself waits
for a dead node until Slurm marks it DOWN, SlurmdTimeout: 300 s by default)."""


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
    explain: Callable[[str], None],
    grace: float = STEP_END_GRACE_S,
    period: float = 0.5,
) -> bool:
    """Wait while the training step's srun (PID) runs. Once the ranks of LAUNCH have recorded a rank dead, stalled
    or out of contact (`txl_dist.supervision.faults`), srun may still wait for the dead node until Slurm marks it DOWN
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
            explain(
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
    parser = argparse.ArgumentParser(prog="python -m txl_dist.supervision.slurm_nodes")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help=f"validate {MIN_NODES_VAR}, {MAX_RELAUNCHES_VAR}, {SPARE_NODES_VAR} and {RANKS_PER_NODE_VAR}"
    )
    check.add_argument("--nodes", default=None, help="the job's node count")
    check.add_argument("--nodelist", default=None, help="the job's Slurm host list: its names are printed, one a line")
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

    def explain(line: str) -> None:
        print(f"slurm.sbatch: {line}", file=sys.stderr, flush=True)

    try:
        if args.command == "check":
            read_limits(os.environ, None if args.nodes is None else _at_least("--nodes", args.nodes, 1))
            if args.nodelist is not None:
                print("\n".join(job_nodes(args.nodelist)), flush=True)
            return 0
        train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
        if args.command == "watch":
            pid, launch = _at_least("--step-pid", args.step_pid, 1), _launch_name(args.launch)
            output_dir = output_dir_of(train_args)
            if output_dir is not None:
                watch_step(pid, fault_log(output_dir), launch, explain)
            return 0
        args.ranks_per_node = _at_least("--ranks-per-node", args.ranks_per_node, 1, MOST_RANKS_PER_NODE)
        args.relaunches = _at_least("--relaunches", args.relaunches, 0)
        args.status = None if args.status in (None, "") else _at_least("--status", args.status, 0)
        args.launch = None if args.launch is None else _launch_name(args.launch)
        decision = relaunch_plan(args, explain)
    except ValueError as error:
        print(f"slurm.sbatch: error: {one_line(error)}", file=sys.stderr)
        return 2
    print(decision, flush=True)
    return 0


HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What a node's name is made of (Slurm's NodeName: letters, digits, '.', '-', '_')."""


def job_nodes(nodelist: str) -> list[str]:
    """The job's nodes from SLURM_JOB_NODELIST, each once; ValueError naming the variable for a name twice or one
    that is no host name (Slurm's ``(null)`` for an empty list)."""
    where = f"SLURM_JOB_NODELIST={nodelist!r}"
    nodes = expand_hostlist(nodelist, "SLURM_JOB_NODELIST")
    strange = [node for node in nodes if not HOST_NAME.fullmatch(node)]
    if strange:
        raise ValueError(f"{where} names {strange[0]!r}, which is no host name (letters, digits, '.', '-', '_')")
    repeated = sorted({node for node in nodes if nodes.count(node) > 1})
    if repeated:
        raise ValueError(f"{where} names {', '.join(repeated)} more than once")
    return nodes


if __name__ == "__main__":
    sys.exit(run_command(main, "slurm.sbatch"))
