"""Where a step's time goes: ``profile.steps=[A, B]`` records steps A to B with torch.profiler, and an
out-of-memory error on CUDA leaves a memory snapshot beside the run's log (docs/profiling.md).

The loop names its phases through `StepProfiler.phase` (data, forward, backward, gradient reduction, optimizer
step, checkpoint, evaluation, and the stop-flag agreement); outside the profiled steps a phase is a null context,
so a run without ``profile.steps``, and every step outside them, pays nothing for it. Each rank writes its own
Chrome trace, ``{output_dir}/profile/steps_A-B/rank_R.pt.trace.json``, which Perfetto and chrome://tracing open.

A profile is a measurement, not the run: a trace that cannot be written is a warning naming its path, and training
goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from txl_dist.config import ProfileConfig
from txl_dist.exit_status import CommandFailure
from txl_dist.fileio import describe_os_error
from txl_dist.run_paths import PROFILE

log = logging.getLogger("txl_dist.training")

PHASES = (
    "data",
    "forward",
    "backward",
    "gradient reduction",
    "optimizer step",
    "checkpoint",
    "evaluation",
    "stop agreement",
)
"""The labels of the loop's phases in a trace (``record_function`` names, each prefixed ``txl_dist/``)."""


def trace_path(output_dir: str | os.PathLike, steps: tuple[int, int], rank: int) -> Path:
    """Where rank ``rank`` writes the trace of ``steps`` (first, last)."""
    return Path(output_dir) / PROFILE / f"steps_{steps[0]}-{steps[1]}" / f"rank_{rank}.pt.trace.json"


class StepProfiler:
    """torch.profiler over ``settings.steps`` of this start of the run; inert when it has none to record.

    ``before_step(n)`` ahead of the step that makes the run's step count ``n``, ``after_step(n)`` once it is
    counted; ``close()`` when the loop ends for any reason (a run stopped inside the window writes what it has).
    """

    def __init__(
        self, settings: ProfileConfig, output_dir: str | os.PathLike, rank: int, device: torch.device, first_step: int
    ):
        self.settings, self.output_dir, self.rank, self.device = settings, Path(output_dir), rank, device
        self._profiler: profile | None = None
        self._engine_hooks: Callable[[], None] | None = None
        self.window = self._window(first_step)
        """(first, last) step this start records, or None."""
        self.written: Path | None = None

    def _window(self, first_step: int) -> tuple[int, int] | None:
        if self.settings.steps is None:
            return None
        first, last = self.settings.steps
        if last < first_step:
            if self.rank == 0:
                log.info(
                    "profile.steps=[%d, %d] lies before this start's first step %d: nothing is profiled",
                    first,
                    last,
                    first_step,
                )
            return None
        return max(first, first_step), last

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """The loop's phase ``name`` (one of `PHASES`) as a labelled range while profiling; else nothing."""
        return record_function(f"txl_dist/{name}") if self._profiler is not None else contextlib.nullcontext()

    def step_range(self, step: int) -> contextlib.AbstractContextManager:
        """The whole of step ``step`` as one labelled range while profiling."""
        return record_function(f"txl_dist/step {step}") if self._profiler is not None else contextlib.nullcontext()

    def before_step(self, step: int, engine) -> None:
        if self.window is None or step != self.window[0] or self._profiler is not None:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            record_shapes=self.settings.record_shapes,
            with_stack=self.settings.with_stack,
            profile_memory=self.device.type == "cuda",
        )
        self._profiler.start()
        self._engine_hooks = label_gradient_reduction(engine, self.phase)
        if self.rank == 0:
            log.info(
                "profiling steps %d-%d with torch.profiler (their tokens/s include its cost); traces: %s",
                *self.window,
                trace_path(self.output_dir, self.window, 0).parent,
            )

    def after_step(self, step: int) -> Path | None:
        """The trace's path once the window's last step has run (None before and after)."""
        if self._profiler is None or self.window is None or step < self.window[1]:
            return None
        return self._finish(step)

    def close(self, step: int) -> Path | None:
        """The loop has ended: a window still open is written as far as it got."""
        return self._finish(step) if self._profiler is not None else None

    def _finish(self, step: int) -> Path | None:
        profiler, self._profiler = self._profiler, None
        if self._engine_hooks is not None:
            self._engine_hooks()
            self._engine_hooks = None
        assert profiler is not None and self.window is not None
        profiler.stop()
        path = trace_path(self.output_dir, self.window, self.rank)
        short = "" if step >= self.window[1] else f" (stopped at step {step}, before the window's end)"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            profiler.export_chrome_trace(str(partial))
            os.replace(partial, path)
        except OSError as error:
            log.warning("profile: the trace of rank %d was not written (%s)", self.rank, describe_os_error(error))
            return None
        self.written = path
        if self.rank == 0:
            log.info("profile of steps %d-%d written%s: %s (one file per rank)", *self.window, short, path.parent)
        return path


def label_gradient_reduction(engine, phase: Callable[[str], contextlib.AbstractContextManager]) -> Callable[[], None]:
    """Label DeepSpeed's gradient reduction inside ``engine.backward``/``step`` as its own phase; returns the undo.

    DeepSpeed reduces at the accumulation boundary through ``engine.allreduce_gradients`` (ZeRO 0-1: the whole
    all-reduce; ZeRO 2-3: the buckets left when backward ends, the rest having gone out from backward's hooks,
    which the trace shows inside "backward"). It calls it as a method of the engine, so an attribute on the
    instance wraps it for the profiled steps only and the class is left as it is."""
    original = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        with phase("gradient reduction"):
            return original(*args, **kwargs)

    engine.allreduce_gradients = allreduce_gradients

    def undo() -> None:
        with contextlib.suppress(AttributeError):
            del engine.allreduce_gradients

    return undo


def start_memory_history(settings: ProfileConfig, device: torch.device) -> None:
    """profile.memory_history on CUDA: every allocation's stack from now on, for the out-of-memory snapshot."""
    if settings.memory_history and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000)


def snapshot_path(output_dir: str | os.PathLike, rank: int, step: int) -> Path:
    """Beside the run's log: the memory snapshot rank ``rank`` wrote on running out of memory in step ``step``."""
    return Path(output_dir) / f"memory_snapshot_rank_{rank}_step_{step}.pickle"


def dump_cuda_snapshot(path: Path) -> None:
    torch.cuda.memory._dump_snapshot(str(path))


@contextlib.contextmanager
def out_of_memory_snapshot(
    output_dir: str | os.PathLike,
    rank: int,
    device: torch.device,
    step: Callable[[], int],
    dump: Callable[[Path], None] = dump_cuda_snapshot,
) -> Iterator[None]:
    """Around the training loop: a CUDA out-of-memory error writes the allocator's snapshot (``dump``) and
    becomes one line naming the step, the rank and the snapshot (`OutOfDeviceMemory`); pytorch.org/memory_viz
    draws the file. Elsewhere the error passes as it is."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        if device.type != "cuda":
            raise
        at = step() + 1
        path = snapshot_path(output_dir, rank, at)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            dump(path)
            written = f"its memory snapshot is {path} (open it at pytorch.org/memory_viz)"
        except (OSError, RuntimeError) as dump_error:
            written = f"no memory snapshot was written ({path}: {dump_error})"
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        raise OutOfDeviceMemory(
            f"rank {rank} ran out of device memory in step {at} ({first_line}); {written}. Lower train.micro_batch "
            f"(python -m txl_dist.plan says what fits)"
        ) from error


class OutOfDeviceMemory(CommandFailure):
    """A CUDA out-of-memory error in the training loop, with where its snapshot lies."""
