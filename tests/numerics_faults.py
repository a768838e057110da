"""Numerical faults for the ranks a test starts, injected from outside the product: the environment that puts
``tests/scripts/numerics_faults/sitecustomize.py`` on their ``PYTHONPATH`` (what it does: its docstring), and the
digest of the batch a poisoned-data fault is keyed on."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.launcher import run_streams

REPO = Path(__file__).resolve().parents[1]
INJECTOR = REPO / "tests" / "scripts" / "numerics_faults"


def fault_environment(**variables: str | int) -> dict[str, str]:
    """The variables that make the ranks meet a fault: ``nan_at_call="1:45"`` (TXL_TEST_NAN_AT_CALL),
    ``spike_at_call`` with ``spike_factor``, ``poison="SHA,..."``; with the injector on the path."""
    environment = {f"TXL_TEST_{name.upper()}": str(value) for name, value in variables.items()}
    path = os.environ.get("PYTHONPATH")
    environment["PYTHONPATH"] = f"{INJECTOR}{os.pathsep}{path}" if path else str(INJECTOR)
    return environment


def batch_digest(
    shards: Path,
    overrides: list[str],
    *,
    world_size: int,
    rank: int,
    step: int,
    slot: int = 0,
    config: str | Path = REPO / "configs" / "tiny_cpu.yaml",
) -> str:
    """The sha256 of the input tokens of micro-batch ``slot`` of rank ``rank`` at optimizer step ``step`` (counted
    from 1) of a run of ``config`` with ``overrides`` on ``world_size`` ranks: what the injector keys a poisoned
    batch on."""
    streams, _ = run_streams(shards, overrides, world_size=world_size, rank=rank, config=config)
    with streams:
        for batch in streams:
            if batch.step + 1 == step and batch.slot == slot:
                return hashlib.sha256(batch.inputs.contiguous().numpy().tobytes()).hexdigest()
    raise AssertionError("unreachable: the streams are endless")
