"""Resuming a checkpoint under another ZeRO stage or number of ranks: how (`plan_load`), and the conversion.

What DeepSpeed 0.19.8 loads by itself (each pair tried on its CPU accelerator, fp32 and bf16):

- the same stage family (ZeRO 1 and 2 share an optimizer) on the same number of ranks: ``load_checkpoint`` as
  saved; so does ZeRO-0, whose state is whole on every rank, on any number of ranks;
- ZeRO 1/2 <-> 1/2 and 3 -> 3 on another number of ranks: ``ds_to_universal`` then ``load_universal``;
- nothing else. ``ds_to_universal`` finds no optimizer partitions in a ZeRO-0 checkpoint ("can't find
  *_optim_states.pt files"); a universal checkpoint of ZeRO 1/2 has no model-state file under the name ZeRO-3's
  loader globs (``zero_pp_rank_0_mp_rank_*``) and the reverse, so ``load_checkpoint`` asserts on an empty file
  list; their ``zero/optimizer_state.pt`` differ (ZeRO-3's loader reads the step from a nested optimizer state
  dict, ZeRO 1/2's from a ``step.pt`` per parameter, and ZeRO 1/2's wants ``{"param": tensor}`` files where
  ZeRO-3's writer leaves bare tensors); and a ZeRO-0 engine never calls a universal loader at all.

Everything else is converted here (`LoadKind.CONVERTED`), through the one layout every stage can read: a universal
folder whose per-parameter files hold the whole fp32 master weight, Adam's ``exp_avg`` and ``exp_avg_sq`` and the
step, whose ``optimizer_state.pt`` holds both stages' layouts, and whose model-state file is there under both
names (`complete_universal`). A ZeRO-0 checkpoint is written into that layout from its model-state file
(`universal_from_stage0`). ZeRO 1-3 engines then load it with DeepSpeed's own universal loader; a ZeRO-0 engine
takes it through `load_into_stage0` (the module's parameters, then the optimizer's ``load_state_dict``).
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch

from txl_dist.checkpoint_paths import has_optimizer_partitions, model_state_files
from txl_dist.checkpoints import weights_only
from txl_dist.deepspeed_internals import convert_to_universal
from txl_dist.fileio import make_temporary_directory, with_path

log = logging.getLogger("txl_dist.training")

PARAM = "param"
"""The key of the tensor in a universal per-parameter file (DeepSpeed's ``checkpoint.constants.PARAM``)."""
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
STAGE12_MODEL_STATES = "mp_rank_00_model_states.pt"
STAGE3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


class LoadKind(enum.Enum):
    """How a checkpoint is loaded into this run's engine."""

    AS_SAVED = "as saved"
    UNIVERSAL = "through DeepSpeed's universal checkpoint"
    CONVERTED = "converted by txl_dist through the consolidated fp32 weights and Adam states"


def _family(stage: int) -> int:
    return 1 if stage == 2 else stage  # ZeRO 1 and 2 share one optimizer class and one checkpoint layout


def plan_load(
    saved_stages: tuple[int, ...], saved_world_size: int, has_partitions: bool, stage: int, world_size: int
) -> LoadKind:
    """How a checkpoint written at ZeRO ``saved_stages`` (one stage, or the candidates of a checkpoint that did not
    record it) by ``saved_world_size`` ranks, with optimizer partitions per rank or not (``has_partitions``),
    loads into ZeRO ``stage`` on ``world_size`` ranks. See the module docstring for what DeepSpeed loads itself."""
    same_family = all(_family(saved) == _family(stage) for saved in saved_stages)
    if same_family and (saved_world_size == world_size or not has_partitions):
        return LoadKind.AS_SAVED
    if same_family and stage != 0:
        return LoadKind.UNIVERSAL
    return LoadKind.CONVERTED


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a run resumes from and how it is loaded (`txl_dist.checkpoints.manager.CheckpointManager.
    plan_resume`)."""

    tag: str
    load: LoadKind
    saved_stages: tuple[int, ...]
    saved_world_size: int
    stage: int
    world_size: int

    def describe(self) -> str:
        saved = " or ".join(str(stage) for stage in self.saved_stages)
        return (
            f"{self.tag} (ZeRO stage {saved}, {self.saved_world_size} ranks) into ZeRO stage {self.stage} on "
            f"{self.world_size} ranks, {self.load.value}"
        )


def _save(value: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _save_through_python_file(value, path)


_torch_save = torch.save


def _save_through_python_file(value: Any, path: Any, *args: Any, **kwargs: Any) -> None:
    """``torch.save`` to a file that Python writes: torch's own writer of a path reports a failed write (a full
    disk, a file-size limit) as a RuntimeError naming neither the file nor the cause ("unexpected pos 704 vs
    598"); Python's raises the OSError, named here after ``path``."""
    if not isinstance(path, (str, os.PathLike)):
        _torch_save(value, path, *args, **kwargs)
        return
    try:
        with open(path, "wb") as handle:
            _torch_save(value, handle, *args, **kwargs)
    except (OSError, RuntimeError) as error:
        # torch's zip writer meets the failed write, then raises its own RuntimeError while closing the archive.
        failed_write = error if isinstance(error, OSError) else error.__context__
        if not isinstance(failed_write, OSError):
            raise
        raise with_path(failed_write, path) from None


@contextmanager
def writes_that_name_their_failures() -> Iterator[None]:
    """For the length of the block, DeepSpeed's ``torch.save`` calls (``ds_to_universal`` saves by path) write
    through `_save_through_python_file`, so that a failed write is an OSError with its errno and file."""
    torch.save = _save_through_python_file
    try:
        yield
    finally:
        torch.save = _torch_save


def _link_or_copy(source: Path, target: Path) -> None:
    if target.exists():
        return
    try:
        os.link(source, target)  # the same bytes: no second copy of a large model-state file
    except OSError:
        shutil.copy2(source, target)


def universal_from_stage0(tag_dir: Path, folder: Path, names: list[str]) -> None:
    """Write ZeRO-0 checkpoint ``tag_dir`` as a universal folder. ``names``: the model's parameters in
    ``named_parameters()`` order, which is the order of the optimizer's state (the trainer hands DeepSpeed
    ``model.parameters()`` as one group). fp32 training keeps torch's optimizer state per parameter beside the
    module's weights; bf16/fp16 keep fp32 masters in DeepSpeed's wrapper, per parameter or one flat tensor."""
    source = model_state_files(tag_dir)[0]
    state = weights_only.load(source, map_location="cpu")
    module, optimizer = state["module"], state["optimizer"]
    shapes = [module[name].shape for name in names]
    if "fp32_groups" in optimizer or "fp32_groups_flat" in optimizer:
        masters = _per_parameter(
            [t for group in optimizer.get("fp32_groups", [optimizer.get("fp32_groups_flat")]) for t in group], shapes
        )
        inner = optimizer[OPTIMIZER_STATE_DICT]
    else:
        masters, inner = [module[name].float() for name in names], optimizer
    step = next(iter(inner["state"].values()))["step"]
    if sum(len(group["params"]) for group in inner["param_groups"]) == len(names):
        # Torch keeps no state for a parameter that never had a gradient: its moments are zero.
        states = [inner["state"].get(index, {}) for index in range(len(names))]
        moments = {
            key: [state.get(key, torch.zeros(shape)) for state, shape in zip(states, shapes)] for key in ADAM_MOMENTS
        }
    else:  # one flat fp32 tensor per group
        flat = [inner["state"][index] for index in sorted(inner["state"])]
        moments = {key: _per_parameter([state[key] for state in flat], shapes) for key in ADAM_MOMENTS}
    zero = folder / "zero"
    for index, name in enumerate(names):
        _save({PARAM: masters[index].float(), "cat_dim": 0}, zero / name / "fp32.pt")
        for key in ADAM_MOMENTS:
            moment = moments[key][index].float().reshape(shapes[index])
            _save({PARAM: moment, "cat_dim": 0}, zero / name / f"{key}.pt")
        _save(torch.as_tensor(step, dtype=torch.float32).clone(), zero / name / "step.pt")
    _write_optimizer_state(zero, inner["param_groups"], step, {})
    _link_or_copy(source, folder / STAGE12_MODEL_STATES)
    _link_or_copy(source, folder / STAGE3_MODEL_STATES)


def _per_parameter(tensors: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Per-parameter tensors of ``shapes`` from either one tensor per parameter or flat tensors to cut in order."""
    if len(tensors) == len(shapes):
        return [tensor.reshape(shape) for tensor, shape in zip(tensors, shapes)]
    flat = torch.cat([tensor.flatten() for tensor in tensors])
    sizes = [shape.numel() for shape in shapes]
    if flat.numel() != sum(sizes):
        raise ValueError(f"the optimizer state holds {flat.numel()} values, the model's parameters {sum(sizes)}")
    return [part.reshape(shape) for part, shape in zip(flat.split(sizes), shapes)]


def _write_optimizer_state(zero: Path, param_groups: list[dict], step: Any, saved: dict[str, Any]) -> None:
    """``zero/optimizer_state.pt`` readable by ZeRO 1/2 (top-level param groups and loss-scale state) and ZeRO-3
    (the step and param groups in a nested optimizer state dict)."""
    groups = [{**group, "params": [0]} for group in param_groups]
    kept = {key: saved[key] for key in ("loss_scaler", "dynamic_loss_scale", "overflow") if key in saved}
    state = {
        **kept,
        "ds_version": saved.get("ds_version", deepspeed.__version__),
        "param_groups": groups,
        OPTIMIZER_STATE_DICT: {"state": {0: {"step": step}}, "param_groups": groups},
    }
    _save(state, zero / "optimizer_state.pt")


def complete_universal(folder: Path) -> None:
    """Make ``ds_to_universal``'s folder readable by every stage: a ``{"param": tensor}`` file and a ``step.pt``
    per parameter, both layouts of ``optimizer_state.pt``, and the model-state file under both names."""
    zero = folder / "zero"
    saved = weights_only.load(zero / "optimizer_state.pt", map_location="cpu")
    nested = saved.get(OPTIMIZER_STATE_DICT)
    if isinstance(nested, dict) and "state" in nested:  # written from ZeRO-3
        step, groups = nested["state"][0]["step"], nested["param_groups"]
    else:
        step, groups = weights_only.load(sorted(zero.glob("*/step.pt"))[0]), saved["param_groups"]
    for param_dir in sorted(path for path in zero.iterdir() if path.is_dir()):
        for path in param_dir.glob("*.pt"):
            value = weights_only.load(path, map_location="cpu")
            if path.name != "step.pt" and not isinstance(value, dict):
                _save({PARAM: value, "cat_dim": 0}, path)
        if not (param_dir / "step.pt").is_file():
            _save(torch.as_tensor(step, dtype=torch.float32).clone(), param_dir / "step.pt")
    _write_optimizer_state(zero, groups, step, saved)
    sources = sorted(folder.glob("*model_states.pt"))
    for name in (STAGE12_MODEL_STATES, STAGE3_MODEL_STATES):
        _link_or_copy(sources[0], folder / name)


def _read_full(path: Path, parameter: torch.Tensor) -> torch.Tensor:
    """A whole parameter's tensor from a universal file, in the parameter's shape (ZeRO-3 writes them flat); a
    moment of a parameter that never had a gradient (no file) is zero."""
    if not path.is_file() and path.name != "fp32.pt":
        return torch.zeros(parameter.shape, dtype=torch.float32)
    return weights_only.load(path, map_location="cpu")[PARAM].float().reshape(parameter.shape)


def load_into_stage0(engine, folder: Path) -> dict[str, Any]:
    """Load universal ``folder`` into a ZeRO-0 engine: the module's parameters, the optimizer's fp32 masters and
    Adam's moments and step, the scheduler and DeepSpeed's step counters. Returns the model-state file's
    contents (the client state among them), as ``load_checkpoint`` returns them."""
    zero = folder / "zero"
    named = list(engine.module.named_parameters())
    read = {
        key: [_read_full(zero / name / f"{key}.pt", parameter) for name, parameter in named]
        for key in ("fp32", *ADAM_MOMENTS)
    }
    step = weights_only.load(zero / named[0][0] / "step.pt", map_location="cpu")
    groups = weights_only.load(zero / "optimizer_state.pt", map_location="cpu")["param_groups"]
    with torch.no_grad():
        for (_, parameter), master in zip(named, read["fp32"]):
            parameter.copy_(master)
    optimizer = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):  # fp32: the parameters are the masters
        inner, inner_params = optimizer, [p for _, p in named]
        outer = None
    else:  # DeepSpeed's bf16/fp16 wrapper around torch's optimizer, over fp32 copies
        inner, outer = optimizer.optimizer, optimizer.state_dict()
        inner_params = [p for group in inner.param_groups for p in group["params"]]
    flat = len(inner_params) != len(named)
    tensors = {key: [torch.cat([t.flatten() for t in values])] if flat else values for key, values in read.items()}
    state = {
        "state": {
            index: {"step": step.clone(), **{key: tensors[key][index] for key in ADAM_MOMENTS}}
            for index in range(len(inner_params))
        },
        "param_groups": [{**groups[0], "params": list(range(len(inner_params)))}],
    }
    if outer is None:
        inner.load_state_dict(state)
    else:
        outer[OPTIMIZER_STATE_DICT] = state
        masters_key = "fp32_groups_flat" if "fp32_groups_flat" in outer else "fp32_groups"
        outer[masters_key] = tensors["fp32"] if flat else [tensors["fp32"]]
        optimizer.load_state_dict(outer)
    model_state = weights_only.load(folder / STAGE12_MODEL_STATES, map_location="cpu")
    if engine.lr_scheduler is not None and model_state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(model_state["lr_scheduler"])
    engine.global_steps = model_state["global_steps"]
    engine.global_samples = model_state.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = model_state["skipped_steps"]
    return model_state


def write_universal(plan: ResumePlan, source: Path, target: Path, names: list[str]) -> None:
    """Checkpoint folder ``source`` in DeepSpeed's universal layout at ``target``, completed for every stage when
    ``plan`` converts (`complete_universal`); ``names``: the model's parameters in ``named_parameters()`` order.
    Written into a staging folder beside it and renamed when whole; on any failure the staging folder is removed,
    and a failed write (no space, a read-only or full file system) is an OSError naming ``target``."""
    shutil.rmtree(target, ignore_errors=True)
    staging = make_temporary_directory(target.parent, f".{target.name}.")
    try:
        with writes_that_name_their_failures():
            _convert(plan, source, staging, names)
        os.replace(staging, target)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):
            log.error("the conversion of %s to DeepSpeed's universal format failed; nothing of it is left", source)
            raise with_path(error, target, replace=True) from error
        raise


def _convert(plan: ResumePlan, source: Path, target: Path, names: list[str]) -> None:
    if not has_optimizer_partitions(source):
        universal_from_stage0(source, target, names)
        return
    log.info(
        "converting %s (%d ranks) to DeepSpeed's universal format for %d ranks",
        source,
        plan.saved_world_size,
        plan.world_size,
    )
    with weights_only.deepspeed_loads_weights_only():
        convert_to_universal(source, target, workers=1)
    if plan.load is LoadKind.CONVERTED:
        complete_universal(target)
