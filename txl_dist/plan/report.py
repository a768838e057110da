"""The memory plan as text: its table, whether it fits the device and the largest layout that does.

`describe` is what the trainer logs when a run starts, `plan_comment` what ``--print-config`` appends,
`require_memory_fits` what refuses a run before it starts, and `device_memory_of` the memory of this machine's
accelerator that they compare the plan with.
"""

from __future__ import annotations

from txl_dist.config import RunConfig
from txl_dist.plan.counts import GiB, ModelShape
from txl_dist.plan.memory import largest_micro_batch, plan_memory


def describe(
    cfg: RunConfig, world_size: int, device: str, device_memory: int | None = None, micro_batch: int | None = None
) -> str:
    """The plan as text: the table for the configured (or given) micro-batch and, with ``device_memory``, the
    largest micro-batch that fits and its layout. A layout the trainer would refuse (the global batch does not
    split among the ranks) raises its ValueError."""
    return describe_with_fit(cfg, world_size, device, device_memory, micro_batch)[0]


def describe_with_fit(
    cfg: RunConfig, world_size: int, device: str, device_memory: int | None = None, micro_batch: int | None = None
) -> tuple[str, bool | None]:
    """(`describe`'s text, whether the planned layout fits ``device_memory``: None without one)."""
    shape = ModelShape.of(cfg.model)
    layout = cfg.train.batch_split(world_size, micro_batch)  # the trainer's rules, its message
    plan = plan_memory(cfg, world_size, layout.micro_batch, device, shape)
    model = cfg.model
    lines = [
        f"memory plan: {cfg.model_preset or 'model'} ({shape.parameters:,} parameters, n_token "
        f"{model.n_token:,}), {world_size} rank(s) of {device}, {cfg.precision.dtype}, ZeRO-{cfg.zero.stage}"
        f"{' with optimizer offload' if cfg.zero.offload_optimizer != 'none' else ''}, micro-batch "
        f"{plan.micro_batch} x tgt_len {model.tgt_len} (mem_len {model.mem_len}), {plan.grad_accum} "
        f"accumulation step(s)",
        plan.table(),
    ]
    fits = None
    if device_memory is not None:
        fit = largest_micro_batch(cfg, world_size, device_memory, device, shape)
        fits = plan.needed() <= device_memory
        verdict = "fits" if fits else "does NOT fit"
        lines.append(f"micro-batch {plan.micro_batch} {verdict} in {device_memory / GiB:.1f} GiB per rank")
        if fit.largest_any == 0:
            lines.append("no micro-batch fits: use a higher ZeRO stage, optimizer offload or more ranks")
        elif fit.micro_batch is None:
            lines.append(
                f"largest micro-batch that fits: {fit.largest_any}, but none divides global_batch "
                f"{cfg.train.global_batch} / {world_size} ranks"
            )
        else:
            lines.append(
                f"largest micro-batch that fits: {fit.largest_any}; for global_batch "
                f"{cfg.train.global_batch} on {world_size} ranks: train.micro_batch={fit.micro_batch} x "
                f"{fit.grad_accum} accumulation step(s) (planned peak {fit.plan.peak / GiB:.2f} GiB, "
                f"needed {fit.plan.needed() / GiB:.2f} GiB)"
            )
    return "\n".join(lines), fits


def plan_comment(cfg: RunConfig, world_size: int, device: str, device_memory: int | None = None) -> str:
    """`describe` as YAML comment lines (``--print-config`` appends them to the config, which still loads)."""
    return "".join(f"# {line}\n" for line in describe(cfg, world_size, device, device_memory).splitlines())


def device_memory_of(device: str, index: int = 0) -> int | None:
    """Memory of this machine's accelerator ``index`` of ``device`` (None on a CPU or without one)."""
    if device == "cpu":
        return None
    try:
        from deepspeed.accelerator import get_accelerator  # lazy: python -m txl_dist.plan imports no DeepSpeed

        return int(get_accelerator().total_memory(index))
    except Exception:  # no DeepSpeed, no such device here: plan without a device size
        return None


def require_memory_fits(cfg: RunConfig, world_size: int, device: str, device_memory: int | None) -> None:
    """ValueError when the memory plan of a rank (`txl_dist.plan`) needs more than ``device_memory``, naming the
    split that fits; nothing with train.memory_check=false or an unknown device size."""
    if device_memory is None or not cfg.train.memory_check:
        return
    plan = plan_memory(cfg, world_size, None, device)
    if plan.needed() <= device_memory:
        return
    fit = largest_micro_batch(cfg, world_size, device_memory, device)
    if fit.micro_batch is not None:
        advice = f"train.micro_batch={fit.micro_batch} ({fit.grad_accum} accumulation steps) fits"
    else:
        advice = "no micro-batch fits: use a higher ZeRO stage, optimizer offload or more ranks"
    raise ValueError(
        f"micro-batch {plan.micro_batch}: the memory plan needs {plan.needed() / GiB:.2f} GiB per "
        f"rank, the {device} device has {device_memory / GiB:.2f} GiB; {advice} (python -m txl_dist.plan "
        f"shows the plan; train.memory_check=false starts anyway)"
    )
