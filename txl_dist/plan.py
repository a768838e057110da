"""The memory of a training run per rank, planned before it is queued: model states for the ZeRO stage and
offload, activations, mems, DeepSpeed's buffers; the largest micro-batch that fits and the layout that follows.

    python -m txl_dist.plan --config configs/lm1b_large.yaml --world-size 64 --device-memory 80GiB
    python -m txl_dist.plan --config configs/lm1b_base.yaml --world-size 8 --device-memory 80GiB --micro-batch 16
    python -m txl_dist.plan --config configs/lm1b_base.yaml --world-size 2 --device cpu --device-memory 24GiB \\
        data.shards=/data/lm1b/shards          # the vocabulary size from the shards' manifest

Exit status: 0 when the planned layout fits ``--device-memory`` (or none is given), 1 when it does not (the last
line names the layout that fits, or says that none does), 2 for a layout the trainer refuses (the global batch
does not split among the ranks; the same rule and message, `TrainConfig.batch_layout`) or another bad argument.

`plan_memory` is the function; `planned_peak_bytes` the one number (what ``torch.cuda.max_memory_allocated``
reports for the same run, or on a CPU what the trainer logs as ``peak_rss_mb``). The launcher logs the plan when
a run starts and ``--print-config`` prints it. Nothing here imports DeepSpeed; the model is built on PyTorch's
meta device to count its parameters exactly.

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

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Sequence

from txl_dist.config import RunConfig, load_config, with_manifest_vocab
from txl_dist.model.config import ModelConfig
from txl_dist.training.deepspeed_config import BUCKET_ALIGNMENT, bucket_elements

GiB = 1 << 30
MiB = 1 << 20
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4
# DeepSpeed's defaults for settings the typed config does not expose: the all-reduce bucket of ZeRO-0
# ("allreduce_bucket_size") and the size of a stage-3 optimizer sub-group ("sub_group_size").
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
# Process memory outside the tensors. CPU: Python, PyTorch, DeepSpeed (244 MiB before the model is built), then
# gloo, DeepSpeed's 64 MiB shared-memory all-reduce buffer, the shard reader: the tiny model's ranks peak at
# 392 MiB; 430 MiB fits the runs of benchmarks/plan_check.py best. CUDA: the context and kernels, which
# max_memory_allocated does not count.
CPU_PROCESS_BYTES = 430 * MiB
# On a CPU the model is built in fp32 and DeepSpeed then replaces every parameter's tensor (a bf16/fp16 copy, or
# a view of its flat ZeRO buffers). glibc returns a freed block to the system only when it was mmap-ed, which
# blocks of 32 MiB or more always are; the smaller fp32 parameters (a layer's weights) stay in the heap, and
# resident memory with them. Measured: +42 to +107 MiB over the tensors for a 29M-parameter model, +640 MiB for
# lm1b_base, whose layers hold 245M such parameters.
GLIBC_MMAP_THRESHOLD_MAX = 32 * MiB
CPU_HEAP_RETAINED = 0.7
CUDA_CONTEXT_BYTES = 600 * MiB
# The caching allocator rounds and splits blocks; PyTorch's own guidance is to leave a tenth of the device.
FRAGMENTATION_MARGIN = 0.10


# ---- the model's shape ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a model, counted from the module built on the meta device (no memory used)."""

    parameters: int
    """Distinct parameters (tied weights and projections once)."""
    largest_gather: int
    """Elements ZeRO-3 gathers at once for one module: the adaptive softmax (or embedding) with its clusters."""
    heap_sized: int
    """Elements of the parameters whose fp32 tensor is smaller than glibc's largest mmap threshold (32 MiB):
    freed, their memory stays in the process's heap (see CPU_HEAP_RETAINED)."""

    @classmethod
    def of(cls, model: ModelConfig) -> ModelShape:
        import torch

        from txl_dist.model import TransformerXLLM

        with torch.device("meta"):
            module = TransformerXLLM(model)
        parameters = sum(p.numel() for p in module.parameters())
        # ZeRO-3 gathers a module's parameters for its forward: the adaptive input or softmax (all clusters), or
        # one decoder layer (the layers' ModuleList is no module that runs).
        groups = [
            sum(p.numel() for p in module.word_emb.parameters()),
            sum(p.numel() for p in module.crit.parameters()),
        ]
        groups += [sum(p.numel() for p in layer.parameters()) for layer in module.layers]
        heap_sized = sum(p.numel() for p in module.parameters() if p.numel() * FP32 < GLIBC_MMAP_THRESHOLD_MAX)
        return cls(parameters, max(groups), heap_sized)


# ---- activations ---------------------------------------------------------------------------------------------


def layer_activation_bytes(model: ModelConfig, micro_batch: int, compute_bytes: int, training: bool = True) -> int:
    """Bytes one decoder layer saves for its backward pass, for micro_batch rows of tgt_len queries over klen =
    mem_len + tgt_len keys (the memory is full after the first segment).

    With L = tgt_len, M = mem_len, K = M + L, B = micro_batch, h = n_head * d_head, S = B * n_head * L * K
    (the attention scores), b the compute dtype's bytes, read from the saved tensors of
    `txl_dist.model.attention` and `transformer.PositionwiseFF` (reference attention; the fused path saves the
    same inputs and no score-sized tensor):

    - the memory fed to its key/value projection (M B d_model) and the segment fed to the query/key/value
      projection, the feed-forward's input and the two layer norms' inputs (4 L B d_model; 6 with dropout: the
      two dropout outputs), and the norms' mean and 1/std (4 L B), all in the compute dtype;
    - q + u and q + v (2 L B h), the keys and values (2 K B h), the projected relative positions ((K + 1) h: one
      zero row for the shift, shared by the batch) and the attention output fed to o_net (L B h);
    - the softmax probabilities (S, fp32), their cast to the compute dtype for the product with the values
      (S b, under bf16/fp16 only); with attention dropout also its fp32 mask and output (2 S fp32 more, the
      output being the cast under bf16/fp16);
    - the feed-forward's ReLU output L B d_inner (with dropout its output and mask too: 3 L B d_inner).

    `tests/test_plan.py` holds this count to the saved tensors of the model within 5%.
    """
    L, M, B = model.tgt_len, model.mem_len, micro_batch
    K = M + L
    h, b = model.n_head * model.d_head, compute_bytes
    scores = B * model.n_head * L * K
    dropout = training and model.dropout > 0
    attention_dropout = training and model.dropatt > 0
    total = M * B * model.d_model * b + (6 if dropout else 4) * L * B * model.d_model * b + 4 * L * B * b
    total += (3 * L * B + 2 * K * B + K + 1) * h * b
    if attention_dropout:
        total += scores * (2 * FP32 + (b if b != FP32 else FP32))
    else:
        total += scores * (FP32 + (b if b != FP32 else 0))
    total += (3 if dropout else 1) * L * B * model.d_inner * b
    return total


# The word law behind `tail_rows`: P(rank >= r) proportional to (r + 8)^(-0.47), the law that gives a synthetic
# corpus One Billion Word's vocabulary statistics (`data_tools.synthetic_lm1b`), and a margin of 4 on each tail
# cluster's share: real text has heavier tails than the law (1BW's out-of-vocabulary rate is about 0.3% where
# the law gives 0.17%) and a batch can be richer in rare words than the average.
WORD_LAW_EXPONENT, WORD_LAW_OFFSET, TAIL_MARGIN = 1.47, 8.0, 4.0


def tail_rows(model: ModelConfig, rows: int) -> list[int]:
    """Rows each tail cluster of the adaptive softmax computes for ``rows`` targets. The softmax of a tail
    cluster runs only on the targets inside it, so this depends on the text: here the share of the cluster's
    ids [start, end) under the word law above (ids are ranks by frequency), times TAIL_MARGIN. For
    lm1b_base's cutoffs that is 1.4%, 2.9% and 0.2% of the rows. (Should the adaptive softmax come to run every
    tail cluster on every row, return [rows] * n_clusters.)"""
    power = 1.0 - WORD_LAW_EXPONENT

    def at_least(rank: int) -> float:  # unnormalised P(rank >= r) over ranks 1..n_token
        return (rank + WORD_LAW_OFFSET) ** power - (model.n_token + 1 + WORD_LAW_OFFSET) ** power

    total = at_least(1)
    shares = [(at_least(start + 1) - at_least(end + 1)) / total for start, end in model.cluster_bounds()[1:]]
    return [min(rows, math.ceil(rows * TAIL_MARGIN * share)) for share in shares]


def head_activation_bytes(
    model: ModelConfig, micro_batch: int, compute_bytes: int, rows: Sequence[int] | None = None
) -> int:
    """Bytes the adaptive input and the adaptive softmax save for the backward pass of one micro-batch
    (N = micro_batch * tgt_len targets; C0 = cutoffs[0] + n_clusters head logits; E_i the width of cluster i):

    - input: the tokens' embeddings of every cluster before their projection (N E_i), compute dtype, and the
      relative position embeddings all layers share (klen d_model);
    - head cluster: the hidden states and their projection (N d_model + N E_0), compute dtype, and its
      log-probabilities (N C0, fp32); the head's weight and the cluster logits' weight are used in place;
    - each tail cluster over n_i rows (``rows``, default `tail_rows`): the rows' hidden states and projection
      (n_i (d_model + E_i)), compute dtype, and its log-probabilities (n_i S_i, fp32).
    """
    N, b = micro_batch * model.tgt_len, compute_bytes
    dims = model.cluster_dims()
    bounds = model.cluster_bounds()
    head_logits = bounds[0][1] - bounds[0][0] + model.n_clusters
    total = sum(N * dim for dim in dims) * b + (model.mem_len + model.tgt_len) * model.d_model * b
    total += (N * model.d_model + N * dims[0]) * b + N * head_logits * FP32
    for count, (start, end), dim in zip(tail_rows(model, N) if rows is None else rows, bounds[1:], dims[1:]):
        total += count * (model.d_model + dim) * b + count * (end - start) * FP32
    return total


def head_transient_bytes(model: ModelConfig, micro_batch: int, compute_bytes: int) -> int:
    """The largest short-lived block on top of the saved tensors, at the start of the backward pass: the
    gradient of the head cluster's logits, written in fp32 while the log-probabilities are still held (N C0),
    and its copy in the compute dtype when that is narrower (N C0, compute dtype), and the gradient of the
    head's weight with the cluster logits' rows (C0 E_0, compute dtype).
    Measured on CPU with PyTorch's profiler (benchmarks/plan_check.py)."""
    N = micro_batch * model.tgt_len
    head_logits = model.cluster_bounds()[0][1] + model.n_clusters
    logits_grad = N * head_logits * (FP32 + (compute_bytes if compute_bytes < FP32 else 0))
    return logits_grad + head_logits * model.cluster_dims()[0] * compute_bytes


def eval_forward_bytes(model: ModelConfig, batch: int, compute_bytes: int) -> int:
    """The largest transient of an evaluation forward (no autograd: one layer's tensors live at a time), for
    ``batch`` streams of tgt_len queries over K = mem_len + tgt_len keys (the model's segment settings are the
    evaluation's): the attention scores and their softmax (2 S fp32, S = batch n_head tgt_len K, and their cast
    under bf16/fp16), the memory and segment concatenated, their keys and values and the projected positions
    (K batch d_model + 2 K batch h + 2 (K + 1) h, compute dtype), and the head cluster's logits and
    log-probabilities over batch x tgt_len rows (2 N C0 fp32)."""
    L, K, b = model.tgt_len, model.mem_len + model.tgt_len, compute_bytes
    h = model.n_head * model.d_head
    scores = batch * model.n_head * L * K
    total = scores * (2 * FP32 + (b if b != FP32 else 0))
    total += (K * batch * model.d_model + 2 * K * batch * h + 2 * (K + 1) * h) * b
    head_logits = model.cluster_bounds()[0][1] + model.n_clusters
    return total + 2 * batch * L * head_logits * FP32


# ---- the plan ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    where: str
    """"device" or "host" (offloaded optimizer states)."""
    phase: str
    """"steady" (held through the step), "backward" (the forward/backward peak), "step" (the optimizer step:
    activations are gone by then) or "eval" (validation between steps, with the eval section's memory)."""
    formula: str


@dataclasses.dataclass
class MemoryPlan:
    """Per-rank memory of one run; `peak` is the planned peak of the device (host RSS on a CPU)."""

    device: str
    world_size: int
    micro_batch: int
    grad_accum: int
    terms: list[Term]
    parameters: int

    def phase_total(self, phase: str, where: str = "device") -> int:
        return sum(t.bytes for t in self.terms if t.phase == phase and t.where == where)

    @property
    def peak(self) -> int:
        """Held through the step, plus the larger of the backward and the optimizer step (on a CPU the offloaded
        states count too: they share its memory)."""
        places = ("device", "host") if self.device == "cpu" else ("device",)
        total = {
            phase: sum(self.phase_total(phase, where) for where in places)
            for phase in ("steady", "backward", "step", "eval")
        }
        return total["steady"] + max(total["backward"], total["step"], total["eval"])

    @property
    def host(self) -> int:
        """Host memory of a rank for its offloaded optimizer states (on a GPU run; on a CPU they are in
        `peak`)."""
        steady = self.phase_total("steady", "host")
        return steady + max(self.phase_total("backward", "host"), self.phase_total("step", "host"))

    def needed(self) -> int:
        """What the device must hold: on a GPU the peak plus the CUDA context and the allocator's margin."""
        if self.device == "cpu":
            return self.peak
        return int(self.peak * (1 + FRAGMENTATION_MARGIN)) + CUDA_CONTEXT_BYTES

    def table(self) -> str:
        width = max(len(term.name) for term in self.terms) + 2

        def row(name: str, where: str, phase: str, size: int, formula: str) -> str:
            return f"{name:{width}s}{where:8s}{phase:10s}{size / MiB:12,.1f}  {formula}"

        lines = [f"{'term':{width}s}{'where':8s}{'phase':10s}{'MiB':>12s}  formula"]
        lines += [row(t.name, t.where, t.phase, t.bytes, t.formula) for t in self.terms]
        lines.append(row("peak per rank", "device", "", self.peak, "steady + max(backward, step, eval)"))
        if self.host and self.device != "cpu":
            lines.append(row("host per rank", "host", "", self.host, "offloaded optimizer states"))
        if self.device != "cpu":
            lines.append(
                row(
                    "needed on the device",
                    "device",
                    "",
                    self.needed(),
                    f"peak x {1 + FRAGMENTATION_MARGIN:.2f} + CUDA context {CUDA_CONTEXT_BYTES / MiB:.0f} MiB",
                )
            )
        return "\n".join(lines)


def plan_memory(
    cfg: RunConfig,
    world_size: int,
    micro_batch: int | None = None,
    device: str = "cuda",
    shape: ModelShape | None = None,
) -> MemoryPlan:
    """The per-rank memory of ``cfg`` on ``world_size`` ranks of ``device`` ("cuda" or "cpu"), at
    ``micro_batch`` (default: the config's layout for that world size)."""
    # Any accelerator ("cuda", "xpu", ...) is planned as a GPU: allocations counted whole, a context outside them.
    model, zero = cfg.model, cfg.zero
    if micro_batch is None:
        micro_batch, grad_accum, _ = cfg.train.batch_layout(world_size)
    else:
        per_rank = cfg.train.global_batch / (micro_batch * world_size)
        grad_accum = max(1, math.ceil(per_rank))
    shape = shape or ModelShape.of(model)
    P, N = shape.parameters, world_size
    Pn = math.ceil(P / N)
    b = COMPUTE_BYTES[cfg.precision.dtype]
    mixed = b != FP32
    stage = zero.stage
    offload = zero.offload_optimizer != "none" and stage >= 1
    states_at = "host" if offload else "device"
    terms: list[Term] = []

    def add(name: str, size: float, phase: str, formula: str, where: str = "device") -> None:
        terms.append(Term(name, int(size), where, phase, formula))

    # Parameters, master weights, optimizer states.
    if stage < 3:
        add("parameters", P * b, "steady", f"P x {b}")
    else:
        add("parameter partition", Pn * b, "steady", f"P/N x {b}")
        gathered = min(shape.largest_gather + zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters, P)
        add(
            "gathered parameters (ZeRO-3)",
            gathered * b,
            "backward",
            f"(largest module {shape.largest_gather:,} + prefetch bucket) x {b}",
        )
    partition = P if stage == 0 else Pn
    part = "P" if stage == 0 else "P/N"
    if stage >= 1 or mixed:
        add("fp32 master weights", partition * FP32, "steady", f"{part} x 4", states_at)
    add("Adam moments (fp32)", partition * 2 * FP32, "steady", f"{part} x 8", states_at)

    # Gradients and DeepSpeed's buffers. DeepSpeed allocates its reduction bucket whole, which the trainer caps at
    # the model's size (`bucket_elements`).
    bucket = bucket_elements(zero, P)
    bucket_formula = f"min(zero.bucket_size, P rounded up to {BUCKET_ALIGNMENT}) x {b}"
    # ZeRO 0 and 1 hold every gradient once the backward pass is over (the "step" phase); during the pass, the
    # gradients of the layers done grow as their activations are freed, so the pass's peak is at its start.
    if stage == 0:
        add("gradients", P * b, "step", f"P x {b}")
        add(
            "all-reduce bucket (flat copy)",
            min(P, ALLREDUCE_BUCKET_ELEMENTS) * b,
            "step",
            f"min(P, {ALLREDUCE_BUCKET_ELEMENTS:.0e}) x {b}",
        )
        if mixed:
            add("fp32 gradients at the step", P * FP32, "step", "P x 4")
    elif stage == 1:
        add("gradients", P * b, "step", f"P x {b}")
        add("reduction bucket", bucket * b, "step", bucket_formula)
        add("fp32 gradient partition", Pn * FP32, "step", "P/N x 4", states_at)
    elif stage == 2:
        add("gradient partition", Pn * b, "steady", f"P/N x {b}")
        add("reduction bucket", bucket * b, "steady", bucket_formula)
        add("fp32 gradient partition", Pn * FP32, "step", "P/N x 4", states_at)
        add("flat gradient partition", Pn * b, "step", f"P/N x {b}")
    else:
        add("gradient partition", Pn * b, "steady", f"P/N x {b}")
        add("reduction bucket", bucket * b, "steady", bucket_formula)
        if offload:  # the model-sized buffer is made and dropped; the offloaded partition keeps its own
            add("fp32 gradient partition", Pn * FP32, "steady", "P/N x 4", states_at)
        else:
            add("fp32 gradient buffer (ZeRO-3)", P * FP32, "steady", "P x 4 (sized by the unpartitioned model)")

    # Activations, mems.
    layer = layer_activation_bytes(model, micro_batch, b)
    add(
        "activations: layers",
        model.n_layer * layer,
        "backward",
        f"n_layer x {layer / MiB:.2f} MiB (micro-batch {micro_batch})",
    )
    add(
        "activations: embedding and softmax",
        head_activation_bytes(model, micro_batch, b),
        "backward",
        f"micro-batch {micro_batch} x tgt_len {model.tgt_len} rows",
    )
    add(
        "backward transient (softmax head)",
        head_transient_bytes(model, micro_batch, b),
        "backward",
        "logits and their gradients, once",
    )
    mem_bytes = b if model.mem_dtype == "compute" else {"float32": 4, "bfloat16": 2, "float16": 2}[model.mem_dtype]
    add(
        "mems",
        grad_accum * (model.n_layer + 1) * model.mem_len * micro_batch * model.d_model * mem_bytes,
        "steady",
        f"{grad_accum} slot(s) x (n_layer + 1) x mem_len x micro-batch x d_model x {mem_bytes}",
    )
    evaluation = cfg.eval.resolve(model)
    eval_streams = max(1, math.ceil(evaluation.batch_size / world_size))
    add(
        "evaluation mems (read and written)",
        2 * (model.n_layer + 1) * evaluation.mem_len * eval_streams * model.d_model * mem_bytes,
        "eval",
        f"2 x (n_layer + 1) x eval mem_len {evaluation.mem_len} x {eval_streams} stream(s) x d_model x {mem_bytes}",
    )
    eval_model = dataclasses.replace(
        model, tgt_len=evaluation.tgt_len, mem_len=evaluation.mem_len, same_length=evaluation.same_length
    )
    add(
        "evaluation forward (one layer)",
        eval_forward_bytes(eval_model, eval_streams, b),
        "eval",
        f"{eval_streams} stream(s) x eval tgt_len {evaluation.tgt_len} "
        f"over {evaluation.mem_len + evaluation.tgt_len} keys",
    )
    if device == "cpu":
        add("process", CPU_PROCESS_BYTES, "steady", "Python, PyTorch, DeepSpeed, gloo (measured on 2 CPU ranks)")
        if stage > 0 or mixed:  # DeepSpeed replaces the fp32 tensors the model was built with
            add(
                "fp32 build copies kept in the heap",
                shape.heap_sized * FP32 * CPU_HEAP_RETAINED,
                "steady",
                f"{CPU_HEAP_RETAINED} x 4 x parameters in tensors under 32 MiB",
            )
    return MemoryPlan(device, world_size, micro_batch, grad_accum, terms, P)


def planned_peak_bytes(
    cfg: RunConfig, world_size: int = 1, micro_batch: int | None = None, device: str = "cuda"
) -> int:
    """The planned peak per rank: compare with ``torch.cuda.max_memory_allocated()`` after a few steps of the
    same run (or, on a CPU, with the trainer's ``peak_rss_mb``)."""
    return plan_memory(cfg, world_size, micro_batch, device).peak


@dataclasses.dataclass
class Fit:
    micro_batch: int | None
    """The largest micro-batch whose plan fits the device and that divides the global batch per rank."""
    grad_accum: int | None
    largest_any: int
    """The largest micro-batch that fits, whether or not it divides the global batch (0: none fits)."""
    plan: MemoryPlan | None


def largest_micro_batch(
    cfg: RunConfig, world_size: int, device_memory: int, device: str = "cuda", shape: ModelShape | None = None
) -> Fit:
    """The largest micro-batch that fits ``device_memory`` per rank (by doubling, then bisection), and the
    largest one that also makes a layout the trainer accepts (`TrainConfig.batch_layout`), with its accumulation
    steps."""
    shape = shape or ModelShape.of(cfg.model)

    def fits(micro_batch: int) -> bool:
        return plan_memory(cfg, world_size, micro_batch, device, shape).needed() <= device_memory

    largest = 0
    if fits(1):
        high = 1
        while fits(high * 2) and high < 1 << 20:
            high *= 2
        low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        largest = low
    for candidate in range(min(largest, cfg.train.global_batch // world_size), 0, -1):
        try:
            layout = cfg.train.batch_layout(world_size, candidate)
        except ValueError:
            continue
        return Fit(candidate, layout.grad_accum, largest, plan_memory(cfg, world_size, candidate, device, shape))
    return Fit(None, None, largest, None)


# ---- command line --------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "KI": 1024,
    "MI": 1024**2,
    "GI": 1024**3,
    "TI": 1024**4,
}


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '24G', '1.5TiB' -> bytes (GiB = 2^30, GB = 10^9)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a memory size such as 80GiB, 80GB or 24G")
    unit = (match.group(2) or "").upper().removesuffix("B")
    return int(float(match.group(1)) * _UNITS[unit])


def describe(
    cfg: RunConfig, world_size: int, device: str, device_memory: int | None = None, micro_batch: int | None = None
) -> str:
    """The plan as text: the table for the configured (or given) micro-batch and, with ``device_memory``, the
    largest micro-batch that fits and its layout. A layout the trainer would refuse (the global batch does not
    split among the ranks) raises its ValueError."""
    return _describe(cfg, world_size, device, device_memory, micro_batch)[0]


def _describe(
    cfg: RunConfig, world_size: int, device: str, device_memory: int | None = None, micro_batch: int | None = None
) -> tuple[str, bool | None]:
    """(`describe`'s text, whether the planned layout fits ``device_memory``: None without one)."""
    shape = ModelShape.of(cfg.model)
    layout = cfg.train.batch_layout(world_size, micro_batch)  # the trainer's rules, its message
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
        from deepspeed.accelerator import get_accelerator

        return int(get_accelerator().total_memory(index))
    except Exception:  # no DeepSpeed, no such device here: plan without a device size
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m txl_dist.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        required=True,
        metavar="PATH",
        help="run config (repeat to layer files, as for launchers/train.py)",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument("--world-size", type=int, required=True, help="ranks (GPUs) of the run")
    parser.add_argument(
        "--device-memory",
        type=parse_size,
        help="memory per rank, e.g. 80GiB (for CPU ranks: the machine's memory / its ranks)",
    )
    parser.add_argument("--micro-batch", type=int, help="plan this micro-batch instead of the config's")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="model.n_token when the config gives no data.shards manifest (default: the preset's)",
    )
    args = parser.parse_args(argv)
    try:
        if args.world_size < 1:
            raise ValueError(f"--world-size {args.world_size}: must be at least 1")
        if args.micro_batch is not None and args.micro_batch < 1:
            raise ValueError(f"--micro-batch {args.micro_batch}: must be at least 1")
        cfg = load_config(args.config, args.overrides)
        cfg = _with_vocabulary(cfg, args.vocab_size)
        text, fits = _describe(cfg, args.world_size, args.device, args.device_memory, args.micro_batch)
    except ValueError as error:
        parser.error(str(error))
    print(text)
    # A job script tests the status: 1 when the planned layout does not fit (the text names one that does, if any).
    return 1 if fits is False else 0


def _with_vocabulary(cfg: RunConfig, vocab_size: int | None) -> RunConfig:
    if vocab_size is not None:
        return with_manifest_vocab(cfg, vocab_size, "--vocab-size")
    if cfg.data.shards is not None:
        from pathlib import Path

        from txl_dist.data.format import MANIFEST_NAME, read_manifest

        if Path(cfg.data.shards, MANIFEST_NAME).is_file():
            manifest = read_manifest(cfg.data.shards)
            return with_manifest_vocab(cfg, manifest.tokenizer.vocab_size, f"{cfg.data.shards}/{MANIFEST_NAME}")
    return cfg


if __name__ == "__main__":
    sys.exit(main())
