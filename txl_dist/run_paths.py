"""The names inside a run's directory (``train.output_dir``), stated once for the trainer that writes them and
for what reads a run from outside: the Slurm relaunch decision (`txl_dist.supervision.slurm_nodes`), the plots
(`txl_dist.plot`), the checkpoint converters (`txl_dist.convert.zero`) and the command line's pre-flight.

What lies inside the checkpoints folder: `txl_dist.checkpoint_paths`. Bottom layer: imports nothing of
txl_dist (docs/architecture.md, Layers).
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKPOINTS = "checkpoints"
"""The folder of the run's checkpoints (one folder per tag, `txl_dist.checkpoint_paths`)."""
METRICS = "metrics.jsonl"
"""One JSON record per line: the run's start, every logged step and evaluation (`txl_dist.training.run_log`)."""
TENSORBOARD = "tensorboard"
"""TensorBoard's event files, with log.tensorboard=true."""
PROFILE = "profile"
"""The traces of profile.steps, a folder per window of steps (`txl_dist.training.profiling`)."""
FAULTS = "faults.jsonl"
"""The run's fault log: what the ranks found when the run failed, and the Slurm batch script's decisions
(`txl_dist.supervision.faults`)."""
NUMERICS = "numerics.json"
"""The data windows the run skipped after numerical faults and the checkpoints it keeps for them
(`txl_dist.training.numerics`)."""


def checkpoints_dir(output_dir: str | os.PathLike) -> Path:
    """The checkpoints folder of the run in ``output_dir``."""
    return Path(output_dir) / CHECKPOINTS


def fault_log(output_dir: str | os.PathLike) -> Path:
    """The fault log of the run in ``output_dir``."""
    return Path(output_dir) / FAULTS


def numerics_record(output_dir: str | os.PathLike) -> Path:
    """The numerics record of the run in ``output_dir``."""
    return Path(output_dir) / NUMERICS
