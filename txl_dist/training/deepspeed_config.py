"""The one function that turns the typed run config into DeepSpeed's config dict.

The batch is stated once, as train.global_batch (and optionally train.micro_batch); DeepSpeed's three batch keys
follow from it and the world size through `TrainConfig.batch_split`, which is where the arithmetic is checked.
A user's ``--deepspeed_config`` JSON may add or change other DeepSpeed settings on top, never one that the config
owns (`owned_overlay_keys`), under none of DeepSpeed's names for it (`zero_key_names`): the ZeRO stage the memory
plan and the hparams report is the one the engine runs. The merged ZeRO section is checked with DeepSpeed's own
model when the config is read (`check_zero_section`), so that a setting DeepSpeed refuses is one line naming the
file and the key.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import deepspeed
import pydantic
import torch

from txl_dist.config import OptimConfig, PrecisionConfig, TrainConfig, ZeroConfig, merge_mappings
from txl_dist.config.sections import bucket_elements
from txl_dist.deepspeed_internals import zero_config_model

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# The DeepSpeed settings that the typed config decides, by the config key to use instead. An overlay that set one
# would run the engine behind the config's back while the memory plan, the resolved config and the hparams say
# otherwise. Every key the builder writes from the config is here, each `zero_optimization` key on its own (the
# overlay may add DeepSpeed's other ZeRO settings), every other section whole; `owned_overlay_keys` derives the
# list from what the builder writes and fails on a key without a name here.
CONFIG_KEY_OF = {
    **{
        key: "batch sizes are stated once, in train.global_batch and train.micro_batch (gradient accumulation "
        "follows from them and the world size)"
        for key in BATCH_KEYS
    },
    "gradient_clipping": "the gradient clipping is optim.grad_clip",
    "optimizer": "the optimizer is the optim section (optim.name, lr, betas, eps, weight_decay, implementation)",
    "bf16": "the precision is precision.dtype",
    "fp16": "the precision is precision.dtype (its loss scale: precision.initial_scale_power, loss_scale_window, "
    "hysteresis, min_loss_scale)",
    "zero_optimization.reduce_bucket_size": "the bucket size is zero.bucket_size",
    "zero_optimization.allgather_bucket_size": "the bucket size is zero.bucket_size",
    **{f"zero_optimization.{name}": f"the ZeRO setting is zero.{name}" for name in ZeroConfig.__dataclass_fields__},
    # Not in the dict but the trainer's all the same: its own schedule and autocast, and DeepSpeed's other names.
    "scheduler": "the learning-rate schedule is the schedule section (schedule.kind, warmup_steps, ...)",
    "amp": "the precision is precision.dtype",
    "bfloat16": "the precision is precision.dtype",
    "torch_autocast": "the precision is precision.dtype",
}
PARTLY_OWNED_SECTION = "zero_optimization"
"""The one section whose keys the config owns one by one: the overlay may add ZeRO settings the config has not."""
FIXED_KEYS = ("steps_per_print", "wall_clock_breakdown")
"""Keys the builder writes that no config key sets (the trainer logs instead): an overlay may change them."""
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
    ``--deepspeed_config`` JSON merged on top (mappings key by key); it may not set a key the config owns
    (`owned_overlay_keys`).
    ``num_parameters`` (the model's) caps the gradient buckets at the model's size (`bucket_elements`).
    Raises ValueError naming the key and the file."""
    on_cpu = device == "cpu"
    if on_cpu and precision.dtype == "fp16":
        raise ValueError(
            "precision.dtype='fp16' is not allowed on device cpu: 'bf16' or 'fp32' (fp16 training needs a CUDA device)"
        )
    config = _built_config(
        train=train,
        optim=optim,
        precision=precision,
        zero=zero,
        world_size=world_size,
        on_cpu=on_cpu,
        num_parameters=num_parameters,
    )
    if overlay_path is not None:
        merge_mappings(config, read_deepspeed_overlay(overlay_path, owned_overlay_keys(train, world_size)))
        check_zero_section(config[PARTLY_OWNED_SECTION], overlay_path)
    return config


def _built_config(
    *,
    train: TrainConfig,
    optim: OptimConfig,
    precision: PrecisionConfig,
    zero: ZeroConfig,
    world_size: int,
    on_cpu: bool,
    num_parameters: int | None,
) -> dict[str, Any]:
    """`build_deepspeed_config` before the overlay."""
    layout = train.batch_split(world_size)
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


def owned_overlay_keys(train: TrainConfig, world_size: int) -> dict[str, str]:
    """The keys an overlay may not set (``section`` or ``zero_optimization.key``), each with the config key to
    use instead: every key the builder writes for some config (all ZeRO stages, with and without offload, both
    half precisions, DeepSpeed's optimizer section), less `FIXED_KEYS`, and the names of `CONFIG_KEY_OF` that
    are the trainer's though not in the dict."""
    written: set[str] = {"scheduler", "amp", "bfloat16", "torch_autocast"}
    for stage, offload, dtype in itertools.product((0, 1, 2, 3), ("none", "cpu"), ("bf16", "fp16")):
        built = _built_config(
            train=train,
            optim=OptimConfig(implementation="deepspeed"),
            precision=PrecisionConfig(dtype=dtype),
            zero=ZeroConfig(stage=stage, offload_optimizer=offload),
            world_size=world_size,
            on_cpu=False,
            num_parameters=None,
        )
        written |= {key for key in built if key not in FIXED_KEYS and key != PARTLY_OWNED_SECTION}
        written |= {f"{PARTLY_OWNED_SECTION}.{key}" for key in built[PARTLY_OWNED_SECTION]}
    unnamed = written - set(CONFIG_KEY_OF)
    if unnamed:
        raise AssertionError(f"DeepSpeed keys built from the config without a config key in CONFIG_KEY_OF: {unnamed}")
    return {key: CONFIG_KEY_OF[key] for key in sorted(written)}


def read_deepspeed_overlay(path: str, owned: dict[str, str]) -> dict[str, Any]:
    """A ``--deepspeed_config`` JSON file as a dict; ValueError naming the file when it is not one, or naming the
    first key it sets that is in ``owned`` (`owned_overlay_keys`) and the config key to use instead."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--deepspeed_config {path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--deepspeed_config {path}: the top level must be a JSON object")
    section = data.get(PARTLY_OWNED_SECTION, {})
    if not isinstance(section, dict):
        raise ValueError(
            f"--deepspeed_config {path} sets {PARTLY_OWNED_SECTION!r} to {section!r}, which is not allowed: a JSON "
            f"object of ZeRO settings the config does not set (the stage is zero.stage)"
        )
    for key in [*data, *(f"{PARTLY_OWNED_SECTION}.{key}" for key in section)]:
        if key in owned:
            raise ValueError(f"--deepspeed_config {path} sets {key!r}, which is not allowed: {owned[key]}")
    if section:
        names = zero_key_names()
        for key in section:
            for other in sorted(names.get(key, ())):
                if f"{PARTLY_OWNED_SECTION}.{other}" in owned:
                    raise ValueError(
                        f"--deepspeed_config {path} sets '{PARTLY_OWNED_SECTION}.{key}' (DeepSpeed's alias of "
                        f"'{other}'), which is not allowed: {owned[f'{PARTLY_OWNED_SECTION}.{other}']}"
                    )
    return data


def zero_key_names() -> dict[str, set[str]]:
    """Each key of DeepSpeed's ``zero_optimization`` section that has other names, with those names: a field and
    its alias (``prefetch_bucket_size`` and ``stage3_prefetch_bucket_size``), a deprecated field and the one that
    replaces it (``cpu_offload`` and ``offload_optimizer``, ``cpu_offload_use_pin_memory`` and both offloads),
    read from DeepSpeed's own model (`DeepSpeedZeroConfig`), so that an overlay cannot set an owned key under
    another name."""
    names: dict[str, set[str]] = {}
    zero_model = zero_config_model()
    for name, field in zero_model.model_fields.items():
        others = {field.alias} if field.alias else set()
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("deprecated") and isinstance(extra.get("new_param"), str):
            others |= set(extra["new_param"].split(" or "))
        for alias in set(others):  # a replacement's own alias: stage3_gather_fp16_... -> gather_16bit_... -> stage3_
            replacement = zero_model.model_fields.get(alias)
            if replacement is not None and replacement.alias:
                others.add(replacement.alias)
        for key in others:
            names.setdefault(name, set()).add(key)
            names.setdefault(key, set()).add(name)
    return names


def check_zero_section(section: dict[str, Any], path: str) -> None:
    """ValueError naming the ``--deepspeed_config`` file and the key when DeepSpeed's own model of the
    ``zero_optimization`` section (`DeepSpeedZeroConfig`) refuses the merged section: a misspelt key, a value
    of the wrong type or range, settings it refuses together. Checked when the config is read, not when the
    engine starts on every rank."""
    try:
        zero_config_model()(**section)
    except pydantic.ValidationError as error:
        problems = error.errors()
        first = problems[0]
        message = _one_line(first["msg"])
        for prefix in ("Value error, ", "Assertion failed, "):  # pydantic's words for a validator's own error
            message = message.removeprefix(prefix)
        if first["type"] == "extra_forbidden":
            message = f"no such ZeRO setting in DeepSpeed {deepspeed.__version__} (or given twice, under two names)"
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        if not first["loc"]:  # a check of the whole section
            raise ValueError(f"--deepspeed_config {path}: {_REFUSED_SECTION}: {message}{more}") from None
        key = ".".join(str(part) for part in (PARTLY_OWNED_SECTION, *first["loc"]))
        raise ValueError(
            f"--deepspeed_config {path} sets {key!r} to {first['input']!r}, which DeepSpeed refuses: {message}{more}"
        ) from None
    except AssertionError as error:  # DeepSpeed checks its deprecated fields with asserts
        raise ValueError(f"--deepspeed_config {path}: {_REFUSED_SECTION}: {_one_line(str(error))}") from None


_REFUSED_SECTION = f"DeepSpeed refuses the {PARTLY_OWNED_SECTION!r} section (the run config's with this file's on top)"


def _one_line(text: str) -> str:
    """The first line of a library's message, whatever it holds."""
    return (text.strip().splitlines() or ["(no message)"])[0]
