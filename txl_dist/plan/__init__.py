"""The memory of a training run per rank, planned before it is queued: model states for the ZeRO stage and
offload, activations, mems, DeepSpeed's buffers; the largest micro-batch that fits and the layout that follows.

    python -m txl_dist.plan --config configs/lm1b_large.yaml --world-size 64 --device-memory 80GiB
    python -m txl_dist.plan --config configs/lm1b_base.yaml --world-size 8 --device-memory 80GiB --micro-batch 16
    python -m txl_dist.plan --config configs/lm1b_base.yaml --world-size 2 --device cpu --device-memory 24GiB \\
        data.shards=/data/lm1b/shards          # the vocabulary size from the shards' manifest
    python -m txl_dist.plan --config configs/lm1b_base.yaml --hostfile hostfile --device-memory 80GiB
                                               # the world size: the hostfile's slots (checked as the runner needs)

Exit status: 0 when the planned layout fits ``--device-memory`` (or none is given), 3 when it does not (the last
line names the layout that fits, or says that none does), 2 for a layout the trainer refuses (the global batch
does not split among the ranks; the same rule and message, `TrainConfig.batch_split`) or another bad argument.

`plan_memory` is the function; `planned_peak_bytes` the one number (what ``torch.cuda.max_memory_allocated``
reports for the same run, or on a CPU what the trainer logs as ``peak_rss_mb``). The launcher logs the plan when
a run starts and ``--print-config`` prints it. Nothing here imports DeepSpeed but `device_memory_of`, which asks
its accelerator for a GPU's size; the model is built on PyTorch's meta device to count its parameters exactly.

Layer 4 (docs/architecture.md, Layers): may import layers 1-4; today the model, the data (a manifest's
vocabulary), the rendezvous (a hostfile's slots), config and the bottom layer; never checkpoints or training. The
names below are imported on first use (`txl_dist.lazy_names`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from txl_dist.lazy_names import lazy_names

# Imported on first use: `python -m txl_dist.plan --help` imports this package, and the planner's counts build the
# model on PyTorch's meta device (torch: seconds).
_HOMES = {
    "main": "txl_dist.plan.cli",
    "parse_size": "txl_dist.plan.cli",
    "GiB": "txl_dist.plan.counts",
    "MiB": "txl_dist.plan.counts",
    "ModelShape": "txl_dist.plan.counts",
    "eval_forward_bytes": "txl_dist.plan.counts",
    "head_activation_bytes": "txl_dist.plan.counts",
    "head_transient_bytes": "txl_dist.plan.counts",
    "layer_activation_bytes": "txl_dist.plan.counts",
    "tail_rows": "txl_dist.plan.counts",
    "Fit": "txl_dist.plan.memory",
    "MemoryPlan": "txl_dist.plan.memory",
    "Term": "txl_dist.plan.memory",
    "largest_micro_batch": "txl_dist.plan.memory",
    "plan_memory": "txl_dist.plan.memory",
    "planned_peak_bytes": "txl_dist.plan.memory",
    "describe": "txl_dist.plan.report",
    "device_memory_of": "txl_dist.plan.report",
    "plan_comment": "txl_dist.plan.report",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:
    from txl_dist.plan.cli import main, parse_size  # noqa: F401
    from txl_dist.plan.counts import (  # noqa: F401
        GiB,
        MiB,
        ModelShape,
        eval_forward_bytes,
        head_activation_bytes,
        head_transient_bytes,
        layer_activation_bytes,
        tail_rows,
    )
    from txl_dist.plan.memory import (  # noqa: F401
        Fit,
        MemoryPlan,
        Term,
        largest_micro_batch,
        plan_memory,
        planned_peak_bytes,
    )
    from txl_dist.plan.report import describe, device_memory_of, plan_comment  # noqa: F401

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
