"""What a run reports, from rank 0 only: console lines, TensorBoard scalars and ``metrics.jsonl``.

Every other rank gets the same object with ``enabled=False``, so call sites need no rank checks. On resume the
records after the resumed step (written before an interruption, then lost with it) are dropped from
``metrics.jsonl`` and TensorBoard (``purge_step``), so both read as one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from txl_dist.fileio import atomic_write_text

log = logging.getLogger("txl_dist.training")

METRICS = "metrics.jsonl"


class RunLogger:
    def __init__(self, output_dir: str | os.PathLike, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self._writer = None
        self._metrics = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.output_dir / METRICS
        self._truncate_after(metrics_path, resume_step)
        self._metrics = open(metrics_path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(
                log_dir=str(self.output_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None
            )

    @staticmethod
    def _truncate_after(path: Path, step: int) -> None:
        if not path.is_file():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
        atomic_write_text(path, "".join(line + "\n" for line in kept))

    def info(self, message: str, *args: Any) -> None:
        if self.enabled:
            log.info(message, *args)

    def record(self, step: int, kind: str, values: dict[str, float | int | None]) -> None:
        """One metrics.jsonl line ``{"step", "kind", ...values}`` and TensorBoard scalars ``{kind}/{name}``."""
        if not self.enabled:
            return
        clean = {k: v for k, v in values.items() if v is not None}
        self._metrics.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self._metrics.flush()
        if self._writer is not None:
            for name, value in clean.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._writer.add_scalar(f"{kind}/{name}", value, step)
            self._writer.flush()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._writer is not None:
            self._writer.close()
