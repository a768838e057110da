"""This process's place among the ranks: its device, the process group it joins, rank 0's values shared.

The training loop and the multi-rank launchers (evaluate.py) start the same way: the device DeepSpeed's
accelerator names (DS_ACCELERATOR=cpu forces the CPU), then the world of `txl_dist.rendezvous.process_group.start`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from txl_dist.rendezvous import process_group
from txl_dist.rendezvous.launch_env import LaunchEnvironment

log = logging.getLogger("txl_dist.training")


class Place(NamedTuple):
    """This rank's index, the number of ranks, this rank's device, and every rank's host name (gathered once, at
    the rendezvous)."""

    rank: int
    world_size: int
    device: torch.device
    hosts: tuple[str, ...] = ()


def local_device(device_type: str | None = None) -> torch.device:
    """This rank's device, made current: the accelerator's device of index LOCAL_RANK, modulo the devices this
    process sees (a launcher that binds one device per task, srun --gpus-per-task, leaves each rank one).
    ``device_type``: the accelerator's name as the caller found it (None: asked here)."""
    accelerator = get_accelerator()
    device_type = device_type or accelerator.device_name()
    if device_type == "cpu":
        return torch.device("cpu")
    device_index = int(os.environ.get("LOCAL_RANK", "0")) % max(accelerator.device_count(), 1)
    accelerator.set_device(device_index)
    return torch.device(device_type, device_index)


def join(launch: LaunchEnvironment | None = None, device_type: str | None = None) -> Place:
    """Collective: this rank's device (of ``device_type``, None: the accelerator's), then the process group
    (`launch_env.apply` has run: ``launch`` is what it returned, None to read the launcher's variables again); rank
    0 logs the ranks' environment."""
    device = local_device(device_type)
    rank, world_size, environments = process_group.start(device.type, launch)
    if rank == 0:
        log.info(
            "ranks' environment: %s on %s",
            process_group.describe_environment(environments[0]),
            ", ".join(sorted({record["host"] for record in environments})),
        )
    return Place(rank, world_size, device, tuple(record["host"] for record in environments))


def broadcast(value: Any) -> Any:
    """Collective: rank 0's value on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None, device: torch.device) -> dict[str, torch.Tensor]:
    """Collective: rank 0's ``tensors`` (None elsewhere) on every rank, on ``device``: their names, shapes and
    dtypes first, then each tensor. Without a process group, ``tensors`` itself."""
    if not dist.is_initialized():
        return dict(tensors or {})
    layout = broadcast({name: (t.shape, t.dtype) for name, t in tensors.items()} if tensors is not None else None)
    received = {}
    for name, (shape, dtype) in sorted(layout.items()):
        tensor = tensors[name].to(device) if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        received[name] = tensor
    return received
