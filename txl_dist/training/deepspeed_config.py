"""The one function that turns the typed run config into DeepSpeed's config dict.

The batch is stated once, as train.global_batch (and optionally train.micro_batch); DeepSpeed's three batch keys
follow from it and the world size through `TrainConfig.batch_layout`, which is where the arithmetic is checked.
A user's ``--deepspeed_config`` JSON may add or change other DeepSpeed settings on top.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from txl_dist.config import OptimConfig, PrecisionConfig, TrainConfig, ZeroConfig, merge_mappings
from txl_dist.config.sections import bucket_elements

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Settings the typed config owns: an overlay that set them would silently disagree with what the trainer does
# (its schedule, its autocast dtype).
OWNED_KEYS = {
    **{
        key: "batch sizes are stated once, in train.global_batch and train.micro_batch (gradient accumulation "
        "follows from them and the world size)"
        for key in BATCH_KEYS
    },
    "scheduler": "the learning-rate schedule is the schedule section (schedule.kind, warmup_steps, ...)",
    "amp": "the precision is precision.dtype",
    "optimizer": "the optimizer is the optim section (optim.name, lr, betas, eps, weight_decay, implementation)",
    "bfloat16": "the precision is precision.dtype",
}
# DeepSpeed prints its own step line every steps_per_print steps; the trainer logs instead.
STEPS_PER_PRINT = 2**31 - 1


def build_deepspeed_config(
    *,
    train: TrainConfig,
    optim: OptimConfig,
    precision: PrecisionConfig,
    zero: ZeroConfig,
    world_size: int,
    device: str,
    overlay_path: str | None = None,
    num_parameters: int | None = None,
) -> dict[str, Any]:
    """DeepSpeed's config for ``world_size`` ranks on ``device`` ("cpu" or an accelerator such as "cuda").

    With ``optim.implementation="torch"`` (and no offload) the dict has no optimizer section: the trainer builds
    torch's fused Adam itself (`build_torch_optimizer`) and hands it to DeepSpeed. Otherwise DeepSpeed builds it
    from the section: FusedAdam on an accelerator, torch's Adam on CPU (``torch_adam``), DeepSpeed's CPU Adam when
    optimizer states are offloaded. ``overlay_path`` names a user's
    ``--deepspeed_config`` JSON merged on top (mappings key by key); it may not set the keys in `OWNED_KEYS`.
    ``num_parameters`` (the model's) caps the gradient buckets at the model's size (`bucket_elements`).
    Raises ValueError naming the key and the file."""
    layout = train.batch_layout(world_size)
    on_cpu = device == "cpu"
    if on_cpu and precision.dtype == "fp16":
        raise ValueError(
            "precision.dtype='fp16' is not allowed on device cpu: 'bf16' or 'fp32' (fp16 training needs a CUDA device)"
        )
    config: dict[str, Any] = {
        "train_batch_size": train.global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": _zero_section(zero, on_cpu=on_cpu, num_parameters=num_parameters),
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    offloaded = zero.offload_optimizer != "none"
    if optim.implementation == "deepspeed" or offloaded:
        config["optimizer"] = _optimizer_section(optim, offloaded=offloaded, on_cpu=on_cpu)
    if precision.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision.dtype == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0 = dynamic loss scaling
            "initial_scale_power": precision.initial_scale_power,
            "loss_scale_window": precision.loss_scale_window,
            "hysteresis": precision.hysteresis,
            "min_loss_scale": precision.min_loss_scale,
        }
    if overlay_path is not None:
        config = _apply_overlay(config, overlay_path, precision.dtype)
    return config


def _optimizer_section(optim: OptimConfig, offloaded: bool, on_cpu: bool) -> dict[str, Any]:
    params: dict[str, Any] = {
        "lr": optim.lr,
        "betas": list(optim.betas),
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    if optim.name == "adam":
        # DeepSpeed turns "Adam" into AdamW unless told otherwise.
        params["adam_w_mode"] = False
    if on_cpu and not offloaded:
        # FusedAdam is a CUDA kernel; with offload DeepSpeed's CPU Adam is chosen instead of either.
        params["torch_adam"] = True
    return {"type": "AdamW" if optim.name == "adamw" else "Adam", "params": params}


def build_torch_optimizer(optim: OptimConfig, parameters):
    """torch's Adam or AdamW (a ``torch.optim.Optimizer``) with ``fused=True``: one kernel for all parameters per
    step, on CUDA and on CPU.

    The parameters may still be on the CPU (DeepSpeed moves them, or its ZeRO partitions, to the device later);
    the fused kernel is chosen per device at each step."""
    kind = torch.optim.AdamW if optim.name == "adamw" else torch.optim.Adam
    return kind(
        parameters, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay, fused=True
    )


def _zero_section(zero: ZeroConfig, on_cpu: bool, num_parameters: int | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": zero.stage}
    bucket = bucket_elements(zero, num_parameters)
    if zero.stage >= 1:
        section["reduce_bucket_size"] = bucket
    if zero.stage in (1, 2):
        section["allgather_bucket_size"] = bucket
    if zero.stage == 3:
        section["stage3_prefetch_bucket_size"] = zero.stage3_prefetch_bucket_size
        section["stage3_param_persistence_threshold"] = zero.stage3_param_persistence_threshold
        section["stage3_max_live_parameters"] = zero.stage3_max_live_parameters
    if zero.offload_optimizer != "none":
        # Pinned host memory speeds copies to and from a GPU; with no GPU it only locks RAM.
        section["offload_optimizer"] = {"device": zero.offload_optimizer, "pin_memory": not on_cpu}
    return section


def read_deepspeed_overlay(path: str) -> dict[str, Any]:
    """A ``--deepspeed_config`` JSON file as a dict; ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--deepspeed_config {path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--deepspeed_config {path}: the top level must be a JSON object")
    for key in data:
        if key in OWNED_KEYS:
            raise ValueError(f"--deepspeed_config {path} sets {key!r}, which is not allowed: {OWNED_KEYS[key]}")
    return data


def _apply_overlay(config: dict[str, Any], path: str, dtype: str) -> dict[str, Any]:
    merged = copy.deepcopy(config)
    merge_mappings(merged, read_deepspeed_overlay(path))
    for name in ("bf16", "fp16"):
        enabled = merged.get(name, {}).get("enabled", False)
        if bool(enabled) != (dtype == name):
            raise ValueError(
                f"--deepspeed_config {path} sets {name}.enabled={str(enabled).lower()}, which "
                f"disagrees with precision.dtype={dtype!r}: choose the precision with precision.dtype"
            )
    return merged
