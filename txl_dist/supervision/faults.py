"""The run's fault log (``faults.jsonl`` in the run folder, `txl_dist.run_paths.FAULTS`): what the ranks found when
a run failed, and what the Slurm batch script decided about it, one JSON record a line.

The ranks write one record per failure, by the rank that prints the run's one failure message
(`txl_dist.supervision.guard`): which rank failed and on which host, how (``kind``), at which step, the message's last
line, and the launch it belongs to. The batch script (`txl_dist.supervision.slurm_nodes`) reads the records of the step
that just ended to decide at once, without waiting for Slurm to notice a dead node, and appends its own decision
(``kind`` ``plan``), so that a failure that comes back at the same step after a relaunch is recognised and the job
ends instead of looping.

Kinds written by the ranks:

- ``error``: a rank failed with an error it reported itself (a file, a full disk, a bug);
- ``refused``: that error was a refusal of the run's input (a bad file, key or value): a relaunch would meet it
  again, so it is never retried;
- ``died``: a rank ended without a word (SIGKILL, a crash, its host gone): the survivors name it;
- ``stalled``: a rank made no progress for ``train.stall_timeout`` (stopped, its host hung or cut off);
- ``lost_contact``: a rank lost rank 0 and the rendezvous store with it;
- ``numerics``: the run stopped on its own numbers, a fault its rollbacks did not cure
  (`txl_dist.training.numerics`): a relaunch would meet it again, so it is never retried.

``launch`` is the value of ``TXL_LAUNCH`` in the ranks' environment: the batch script sets it to
``JOB.RESTART.RELAUNCH`` for each training step it starts (None elsewhere). A line that is not a record (the one a
dying rank was writing, a damaged one) is skipped with a warning naming the file and the line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

LAUNCH_VAR = "TXL_LAUNCH"
"""The batch script's name of the training step that a rank belongs to (``JOB.RESTART.RELAUNCH``)."""
RANK_KINDS = frozenset({"error", "refused", "died", "stalled", "lost_contact", "numerics"})
"""The kinds of record that the ranks write."""
NEVER_RETRIED_KINDS = frozenset({"refused", "numerics"})
"""Kinds whose failure a relaunch would meet again, whatever the nodes: the job ends."""
NODE_SUSPECT_KINDS = frozenset({"died", "lost_contact"})
"""Kinds where the named rank's host may be gone: the planner asks Slurm to run something there before it trusts
the node again."""
PLAN = "plan"
"""The kind of the batch script's own records: one per decision after a failed step."""


def launch_id(job: str, restart: int | str, relaunch: int | str) -> str:
    """The name of one training step of a Slurm job: its job id, Slurm's restart count, the script's relaunch."""
    return f"{job}.{restart}.{relaunch}"


def append(path: Path, record: dict) -> None:
    """Append RECORD (with the time) as one line, in one write, flushed to the disk: the record must outlive the
    process that writes it, which is about to end. OSError when the folder cannot take it."""
    line = json.dumps({"time": round(time.time(), 3), **record}, sort_keys=True) + "\n"
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode("utf-8"))
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read(path: Path, explain: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Every record of the fault log at PATH, in order ([] when there is none). A line that is no JSON object with
    a string ``kind`` is skipped: EXPLAIN names the file, the line and why."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    records, skipped = [], []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            skipped.append(number)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
            skipped.append(number)
            continue
        records.append(record)
    if skipped:
        lines = ", ".join(str(number) for number in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        explain(f"warning: {path}: skipped {len(skipped)} line(s) that are no fault record (line {lines})")
    return records


def of_launch(records: Iterable[dict], launch: str, kinds: Iterable[str] = RANK_KINDS) -> list[dict]:
    """The records of KINDS that belong to LAUNCH."""
    wanted = set(kinds)
    return [record for record in records if record.get("launch") == launch and record.get("kind") in wanted]


def whole(value: object) -> int | None:
    """A record's step or rank when it is a whole number (not a bool), else None."""
    return value if type(value) is int and value >= 0 else None


def describe(record: dict) -> str:
    """A rank's record for the job's log: ``rank 1 (node2) at step 61: LAST LINE``."""
    rank, step = whole(record.get("rank")), whole(record.get("step"))
    who = f"rank {rank}" if rank is not None else "a rank"
    host = record.get("host")
    where = f" ({host})" if isinstance(host, str) and host else ""
    at = f" at step {step}" if step is not None else ""
    message = record.get("message")
    text = message.strip().splitlines()[-1] if isinstance(message, str) and message.strip() else record["kind"]
    return f"{who}{where}{at}: {text}"
