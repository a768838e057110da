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

What is counted, per rank (P parameters, N ranks, b bytes per element of the compute dtype: 2 for bf16/fp16,
4 for fp32; Pn = P / N, DeepSpeed's partition):

- Parameters in the compute dtype: P b with ZeRO 0-2 (every rank holds them all), Pn b with ZeRO-3 plus the
  parameters gathered for the module being computed and the prefetch bucket (``zero.stage3_*``).
- fp32 master weights (4 Pn; ZeRO-0 under bf16/fp16: 4 P) and Adam's two fp32 moments (8 Pn; ZeRO-0: 8 P):
  torch's fused Adam (``optim.implementation=torch``) and DeepSpeed's keep the same states. ZeRO 1-3 keep a
  fp32 master partition even in fp32 training. With ``zero.offload_optimizer=cpu`` both live in host memory.
- Gradients, as DeepSpeed keeps them: ZeRO 0 and 1 hold them for every parameter (P b), ZeRO-2 its partition (Pn b)
  and a reduction bucket (``zero.bucket_size`` elements, at most P), ZeRO-3 its partition and a fp32 buffer of the
  model's size (DeepSpeed 0.19's stage-3 optimizer sizes it by the unpartitioned parameters); the fp32 gradient of
  the partition made at the optimizer step.
- Activations saved for the backward pass of one micro-batch of tgt_len tokens with mem_len of memory (klen =
  mem_len + tgt_len keys): `layer_activation_bytes` per layer, `head_activation_bytes` for the adaptive
  input and softmax (the head cluster's logits and log-probabilities over micro_batch x tgt_len rows, the tail
  clusters over their expected rows), and the largest transient of the backward pass.
- The mems: grad_accum x (n_layer + 1) x mem_len x micro_batch x d_model (each accumulation slot keeps its own).
- Validation during training, with the eval section's segment settings (the paper's long evaluation memory:
  mem_len 3800 for enwik8_large and text8_large) over eval.batch_size / N streams per rank: the memory read and
  the one being written, and one layer's forward without autograd (`eval_forward_bytes`). It runs between
  steps, when the training activations are gone and the training mems and model states stay: the "eval" phase.
- On a CPU, the process itself (Python, PyTorch, DeepSpeed, gloo and its shared-memory buffer): peak RSS is
  compared, and it includes them. On a GPU, the CUDA context lies outside max_memory_allocated; a run fits when
  the planned peak plus the context and a margin for the caching allocator's fragmentation fit the device.

The activation terms are counts of tensors by shape, read from the model's saved tensors (see the docstrings):
when the model changes (another attention kernel, fewer fp32 copies, fixed shapes in the adaptive softmax),
change the count there. `benchmarks/plan_check.py` measures the peaks of real runs against the plan.
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
