"""Every use of DeepSpeed's internals, behind one seam (Layer 1: it imports no other package of txl_dist).

DeepSpeed's public API -- ``deepspeed.initialize``, ``deepspeed.init_distributed``, ``deepspeed.comm``,
``deepspeed.accelerator.get_accelerator``, the engine's methods -- is used where it is needed. What lies beneath it
(``deepspeed.runtime``, ``deepspeed.checkpoint``, ``deepspeed.utils.zero_to_fp32``, ``deepspeed.ops``,
``deepspeed.comm.torch``, ``deepspeed.constants``) changes between releases without notice, so it is reached from
here only, each use a small named function or class; tests/test_deepspeed_internals.py checks that no other module
of txl_dist imports it, and exercises each of these against the installed DeepSpeed.

Checked on DeepSpeed 0.19.8 (`CHECKED_VERSIONS`; the upper bound of the requirement in pyproject.toml), CPU
accelerator, torch 2.13. A DeepSpeed outside that list is allowed once the suite passes on it: add its version
here and move the bound. What each piece relies on:

- `convert_to_universal`: ``deepspeed.checkpoint.ds_to_universal.main`` takes its command line's namespace (the
  seven attributes of its ``parse_arguments``: input and output folder, extract and merge workers, keep the
  temporary folder, strict, inject missing state) and writes the universal layout into the output folder.
- `consolidate_zero_checkpoint`: ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder,
  tag=)`` reads the model-state and optimizer files of ZeRO 1-3 from ``folder/tag`` and returns the fp32 weights;
  it draws tqdm bars on ``sys.stderr`` (as found when each bar starts) and has no setting to turn them off.
- `build_shm_op`, `SHM_OP_NAME`, `SHM_BUFFER`: ``deepspeed.comm.torch.build_shm_op()`` asks the accelerator for its
  ``ShareMemCommBuilder`` (named ``deepspeed_shm_comm``), JIT-compiles it into ``TORCH_EXTENSIONS_DIR`` and
  prints a line when it loads; the op's C++ (``csrc/cpu/comm/shm.cpp``) names each rank's buffer after the user,
  the rendezvous address and port, and the rank.
- `process_group_timeout`: ``deepspeed.constants.default_pg_timeout``, the timeout DeepSpeed gives its own
  process groups (``DEEPSPEED_TIMEOUT`` minutes).
- `CheckpointEngineWrapper`: the engine keeps its checkpoint engine in ``engine.checkpoint_engine`` and writes and
  reads every checkpoint file through its ``save(state_dict, path)`` and ``load(path, map_location=)``; the
  torch engine's ``zipfile_serialization`` says which format ``torch.save`` writes. The other methods of
  ``deepspeed.runtime.checkpoint_engine.CheckpointEngine`` (create, commit, makedirs, is_decoupled, ...) are passed
  to the wrapped engine.
- `universal_loading`: the engine reads its configuration's ``load_universal_checkpoint`` (the ``checkpoint``
  section's ``load_universal``) at every ``load_checkpoint``, from ``engine._config``, and nowhere else; so one
  engine loads a universal folder and, later, a checkpoint as saved (a rollback after a resume that converted).
- `CHECKPOINT_CLASSES`: the classes DeepSpeed pickles into its checkpoint files (module paths under
  ``deepspeed.runtime`` and ``deepspeed.utils``).
- `zero_config_model`: ``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``, the pydantic model of the
  ``zero_optimization`` section (its fields, their aliases and deprecations).

Importing this module imports neither torch nor DeepSpeed: each function imports what it uses when called, so
that a command's --help, and evaluating or converting an export folder, never load them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import datetime

    import pydantic
    import torch

CHECKED_VERSIONS = ("0.19.8",)
"""The DeepSpeed releases the suite has passed on with this module; the newest is the requirement's upper bound."""


# ---- universal checkpoints -------------------------------------------------------------------------------------------


def convert_to_universal(
    source: str | os.PathLike,
    target: str | os.PathLike,
    *,
    workers: int = 1,
    strict: bool = True,
    inject_missing_state: bool = True,
) -> None:
    """Write the ZeRO 1-3 checkpoint folder ``source`` (one tag's folder, with its ``*_optim_states.pt``) in
    DeepSpeed's universal layout into ``target``: one folder per parameter under ``target/zero`` with its whole
    fp32 weight and optimizer moments, and the model-state files. ``workers``: the processes that extract the
    partitions and that merge them (1: none started). ``strict``: DeepSpeed checks the converted folder.
    ``inject_missing_state``: DeepSpeed fills in the universal-checkpoint info a checkpoint of a plain engine lacks.
    Reads through ``torch.load`` and writes through ``torch.save`` by path (callers may wrap either)."""
    # lazy: importing this module loads no DeepSpeed (txl_dist.convert.zero and txl_dist.checkpoints.weights_only
    # import it at their top, and evaluating or converting an export folder needs none)
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(
        argparse.Namespace(
            input_folder=os.fspath(source),
            output_folder=os.fspath(target),
            num_extract_workers=workers,
            num_merge_workers=workers,
            keep_temp_folder=False,
            strict=strict,
            inject_missing_state=inject_missing_state,
        )
    )


# ---- consolidated weights --------------------------------------------------------------------------------------------


class _WithoutRedrawnLines(io.TextIOBase):
    """A text stream that passes each whole line written to it on to ``target``, except the lines redrawn in place
    (those holding a carriage return): the frames of a progress bar, which rewrites its line with ``\\r`` until it
    ends it with a newline. Warnings and messages, which do not, pass as they come, line by line."""

    def __init__(self, target: TextIO):
        super().__init__()
        self._target = target
        self._line = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        *lines, self._line = (self._line + text).split("\n")
        for line in lines:
            if "\r" not in line:
                self._target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def finish(self) -> None:
        """Pass on what is left of an unfinished line unless it is a bar's."""
        if self._line and "\r" not in self._line:
            self._target.write(self._line)
        self._line = ""
        self.flush()


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """With ``shown`` False, the block's ``sys.stderr`` leaves out progress bars (`_WithoutRedrawnLines`)."""
    if shown:
        yield
        return
    quiet = _WithoutRedrawnLines(sys.stderr)
    try:
        with contextlib.redirect_stderr(quiet):
            yield
    finally:
        quiet.finish()


def consolidate_zero_checkpoint(
    checkpoints_dir: str | os.PathLike, tag: str, *, progress: bool = True
) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of ZeRO 1-3 checkpoint ``checkpoints_dir/tag``, gathered from every rank's
    optimizer partitions on the CPU (tied weights appear under each name). DeepSpeed reports the gathering on
    stdout, and draws progress bars on stderr unless ``progress`` is False. Reads through ``torch.load``
    (callers may wrap it)."""
    # lazy: evaluate and convert of an export folder, and of a ZeRO-0 checkpoint, import no DeepSpeed (0.3 s after
    # torch, and a line from its accelerator on stderr)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with _progress_bars(progress):
        return get_fp32_state_dict_from_zero_checkpoint(os.fspath(checkpoints_dir), tag=tag)


# ---- the shared-memory collective op ---------------------------------------------------------------------------------

SHM_OP_NAME = "deepspeed_shm_comm"
"""The name of DeepSpeed's shared-memory op (its ``ShareMemCommBuilder``): the folder torch's JIT loader builds it
in under ``TORCH_EXTENSIONS_DIR``, and the library's name there."""

SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{address}_{port}_{rank}"
"""The name the op gives a rank's all-reduce buffer, from the rendezvous variables it reads (MASTER_ADDR,
MASTER_PORT)."""


def build_shm_op() -> object | None:
    """DeepSpeed's shared-memory collective op for the current accelerator (the CPU's), compiled by torch's JIT
    loader into ``TORCH_EXTENSIONS_DIR`` on first use and loaded; None where the accelerator has none or DeepSpeed
    finds it incompatible. The line DeepSpeed prints at each load is kept off stdout. Callers serialise builds."""
    # lazy: importing this module loads no DeepSpeed (as in convert_to_universal)
    from deepspeed.comm.torch import build_shm_op as build

    with contextlib.redirect_stdout(io.StringIO()):
        return build()


def process_group_timeout() -> datetime.timedelta:
    """The timeout DeepSpeed gives the process groups it makes (``DEEPSPEED_TIMEOUT`` minutes, 30 unless set), for
    a process group made before DeepSpeed's, which DeepSpeed then wraps."""
    # lazy: importing this module loads no DeepSpeed (as in convert_to_universal)
    from deepspeed.constants import default_pg_timeout

    return default_pg_timeout


# ---- checkpoint files ------------------------------------------------------------------------------------------------


class CheckpointEngineWrapper:
    """Stands in for the checkpoint engine of a DeepSpeed engine (`install`): every file DeepSpeed saves or loads
    goes through `save` and `load`, which pass to the wrapped engine unless a subclass says otherwise; every other
    attribute is the wrapped engine's. Deliberately not a subclass of DeepSpeed's ``CheckpointEngine``, whose
    defaults (``makedirs``, ``is_decoupled``, ...) would hide the wrapped engine's own."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy or an unpickling in progress): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def zipfile_serialization(self) -> bool:
        """Whether ``torch.save`` writes the zip format (DeepSpeed's torch engine's setting; True if it has none)."""
        return getattr(self.inner, "zipfile_serialization", True)

    def save(self, state_dict: Any, path: str) -> None:
        self.inner.save(state_dict, path)

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.inner.load(path, map_location=map_location)

    @classmethod
    def install(cls, engine: Any) -> Any:
        """The instance of this class that ``engine`` saves and loads through, wrapped around its checkpoint engine
        on the first call."""
        current = engine.checkpoint_engine
        if not isinstance(current, cls):
            current = cls(current)
            engine.checkpoint_engine = current
        return current


@contextlib.contextmanager
def universal_loading(engine: Any, universal: bool) -> Iterator[None]:
    """``engine.load_checkpoint`` reads a universal checkpoint (``universal``) or one as saved while inside."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = universal
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


CHECKPOINT_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaleConfig",
    "deepspeed.runtime.fp16.loss_scaler.LossScaleProfile",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The DeepSpeed classes found in its checkpoint files (ZeRO 0-3, fp32/bf16/fp16, universal checkpoints): loss
scalers (fp16 state), the ZeRO stage enum, and the fragment addresses of ZeRO 1/2 partitions. Named, and resolved
by `checkpoint_classes` when first needed."""


def checkpoint_classes() -> list[type]:
    """`CHECKPOINT_CLASSES`, the classes themselves (importing the DeepSpeed modules that define them)."""
    classes = []
    for name in CHECKPOINT_CLASSES:
        module, _, attribute = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attribute))
    return classes


# ---- configuration ---------------------------------------------------------------------------------------------------


def zero_config_model() -> type[pydantic.BaseModel]:
    """DeepSpeed's pydantic model of the ``zero_optimization`` section (``DeepSpeedZeroConfig``): its fields with
    their aliases and deprecations, and its validation of a section."""
    # lazy: importing this module loads no DeepSpeed (as in convert_to_universal)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig
