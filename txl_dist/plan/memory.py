"""The per-rank memory plan of a run: its terms by phase and place, the planned peak, the largest micro-batch.

`plan_memory` adds up, for the ZeRO stage, offload and precision of a config, the model states, the gradients
and DeepSpeed's buffers, the activations (`txl_dist.plan.counts`), the mems and the evaluation between steps;
the package docstring (`python -m txl_dist.plan --help`) says what each term counts.
"""

from __future__ import annotations

import dataclasses
import math

from txl_dist.config import RunConfig, ZeroConfig
from txl_dist.config.model import ModelConfig
from txl_dist.config.sections import BUCKET_ALIGNMENT, bucket_elements
from txl_dist.model.recurrence import MEM_DTYPES
from txl_dist.plan.counts import (
    FP32,
    MiB,
    ModelShape,
    eval_forward_bytes,
    head_activation_bytes,
    head_transient_bytes,
    layer_activation_bytes,
)

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# DeepSpeed's default for a setting the typed config does not expose: the all-reduce bucket of ZeRO-0
# ("allreduce_bucket_size").
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
# Process memory outside the tensors on a CPU: Python, PyTorch, DeepSpeed, then gloo, DeepSpeed's 64 MiB
# shared-memory all-reduce buffer and the shard reader; the value that fits the runs of benchmarks/plan_check.py
# best.
CPU_PROCESS_BYTES = 430 * MiB
# On a CPU the model is built in fp32 and DeepSpeed then replaces every parameter's tensor (a bf16/fp16 copy, or
# a view of its flat ZeRO buffers). The freed fp32 tensors under glibc's mmap threshold stay in the heap, and
# resident memory with them: this share of them, from the runs of benchmarks/plan_check.py.
CPU_HEAP_RETAINED = 0.7
# The CUDA context and kernels, which max_memory_allocated does not count.
CUDA_CONTEXT_BYTES = 600 * MiB
# The caching allocator rounds and splits blocks; PyTorch's own guidance is to leave a tenth of the device.
FRAGMENTATION_MARGIN = 0.10


@dataclasses.dataclass(frozen=True)
class Term:
    """One line of the plan: the bytes of one kind of tensor, where they live and in which phase."""

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


@dataclasses.dataclass(frozen=True)
class _States:
    """What the model-state terms depend on: the parameter counts, the compute dtype, the ZeRO stage and offload."""

    parameters: int
    """P."""
    partition: int
    """Pn = P / N rounded up: DeepSpeed's partition."""
    compute_bytes: int
    """b: 2 for bf16/fp16, 4 for fp32."""
    stage: int
    offload: bool
    """Optimizer states in host memory (``zero.offload_optimizer``, ZeRO 1-3)."""

    @property
    def mixed(self) -> bool:
        return self.compute_bytes != FP32

    @property
    def states_at(self) -> str:
        return "host" if self.offload else "device"


def _term(name: str, size: float, phase: str, formula: str, where: str = "device") -> Term:
    return Term(name, int(size), where, phase, formula)


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
    if micro_batch is None:
        micro_batch, grad_accum, _ = cfg.train.batch_split(world_size)
    else:
        per_rank = cfg.train.global_batch / (micro_batch * world_size)
        grad_accum = max(1, math.ceil(per_rank))
    shape = shape or ModelShape.of(cfg.model)
    states = _States(
        parameters=shape.parameters,
        partition=math.ceil(shape.parameters / world_size),
        compute_bytes=COMPUTE_BYTES[cfg.precision.dtype],
        stage=cfg.zero.stage,
        offload=cfg.zero.offload_optimizer != "none" and cfg.zero.stage >= 1,
    )
    terms = _model_state_terms(states, cfg.zero, shape) + _gradient_terms(states, cfg.zero)
    terms += _activation_terms(cfg.model, micro_batch, grad_accum, states.compute_bytes)
    terms += _evaluation_terms(cfg, world_size, states.compute_bytes)
    if device == "cpu":
        terms += _cpu_process_terms(states, shape)
    return MemoryPlan(device, world_size, micro_batch, grad_accum, terms, shape.parameters)


def _model_state_terms(states: _States, zero: ZeroConfig, shape: ModelShape) -> list[Term]:
    """Parameters, master weights, optimizer states."""
    P, Pn, b = states.parameters, states.partition, states.compute_bytes
    if states.stage < 3:
        terms = [_term("parameters", P * b, "steady", f"P x {b}")]
    else:
        gathered = min(shape.largest_gather + zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters, P)
        terms = [
            _term("parameter partition", Pn * b, "steady", f"P/N x {b}"),
            _term(
                "gathered parameters (ZeRO-3)",
                gathered * b,
                "backward",
                f"(largest module {shape.largest_gather:,} + prefetch bucket) x {b}",
            ),
        ]
    partition = P if states.stage == 0 else Pn
    part = "P" if states.stage == 0 else "P/N"
    if states.stage >= 1 or states.mixed:
        terms.append(_term("fp32 master weights", partition * FP32, "steady", f"{part} x 4", states.states_at))
    terms.append(_term("Adam moments (fp32)", partition * 2 * FP32, "steady", f"{part} x 8", states.states_at))
    return terms


def _gradient_terms(states: _States, zero: ZeroConfig) -> list[Term]:
    """Gradients and DeepSpeed's buffers. DeepSpeed allocates its reduction bucket whole, which the trainer caps at
    the model's size (`bucket_elements`)."""
    P, Pn, b, at = states.parameters, states.partition, states.compute_bytes, states.states_at
    bucket = bucket_elements(zero, P)
    bucket_formula = f"min(zero.bucket_size, P rounded up to {BUCKET_ALIGNMENT}) x {b}"
    # ZeRO 0 and 1 hold every gradient once the backward pass is over (the "step" phase); during the pass, the
    # gradients of the layers done grow as their activations are freed, so the pass's peak is at its start.
    if states.stage == 0:
        terms = [
            _term("gradients", P * b, "step", f"P x {b}"),
            _term(
                "all-reduce bucket (flat copy)",
                min(P, ALLREDUCE_BUCKET_ELEMENTS) * b,
                "step",
                f"min(P, {ALLREDUCE_BUCKET_ELEMENTS:.0e}) x {b}",
            ),
        ]
        if states.mixed:
            terms.append(_term("fp32 gradients at the step", P * FP32, "step", "P x 4"))
        return terms
    if states.stage == 1:
        return [
            _term("gradients", P * b, "step", f"P x {b}"),
            _term("reduction bucket", bucket * b, "step", bucket_formula),
            _term("fp32 gradient partition", Pn * FP32, "step", "P/N x 4", at),
        ]
    terms = [
        _term("gradient partition", Pn * b, "steady", f"P/N x {b}"),
        _term("reduction bucket", bucket * b, "steady", bucket_formula),
    ]
    if states.stage == 2:
        terms.append(_term("fp32 gradient partition", Pn * FP32, "step", "P/N x 4", at))
        terms.append(_term("flat gradient partition", Pn * b, "step", f"P/N x {b}"))
    elif states.offload:  # the model-sized buffer is made and dropped; the offloaded partition keeps its own
        terms.append(_term("fp32 gradient partition", Pn * FP32, "steady", "P/N x 4", at))
    else:
        terms.append(
            _term("fp32 gradient buffer (ZeRO-3)", P * FP32, "steady", "P x 4 (sized by the unpartitioned model)")
        )
    return terms


def _mem_bytes(model: ModelConfig, compute_bytes: int) -> int:
    """Bytes per element of the mems: the compute dtype's, or ``model.mem_dtype``'s."""
    return compute_bytes if model.mem_dtype == "compute" else MEM_DTYPES[model.mem_dtype].itemsize


def _activation_terms(model: ModelConfig, micro_batch: int, grad_accum: int, compute_bytes: int) -> list[Term]:
    """Activations saved for the backward pass of one micro-batch, and the mems of every accumulation slot."""
    b = compute_bytes
    layer = layer_activation_bytes(model, micro_batch, b)
    mem_bytes = _mem_bytes(model, b)
    return [
        _term(
            "activations: layers",
            model.n_layer * layer,
            "backward",
            f"n_layer x {layer / MiB:.2f} MiB (micro-batch {micro_batch})",
        ),
        _term(
            "activations: embedding and softmax",
            head_activation_bytes(model, micro_batch, b),
            "backward",
            f"micro-batch {micro_batch} x tgt_len {model.tgt_len} rows",
        ),
        _term(
            "backward transient (softmax head)",
            head_transient_bytes(model, micro_batch, b),
            "backward",
            "logits and their gradients, once",
        ),
        _term(
            "mems",
            grad_accum * (model.n_layer + 1) * model.mem_len * micro_batch * model.d_model * mem_bytes,
            "steady",
            f"{grad_accum} slot(s) x (n_layer + 1) x mem_len x micro-batch x d_model x {mem_bytes}",
        ),
    ]


def _evaluation_terms(cfg: RunConfig, world_size: int, compute_bytes: int) -> list[Term]:
    """Validation between steps, with the eval section's segment settings, over its streams of this rank."""
    model = cfg.model
    evaluation = cfg.eval.resolve(model)
    eval_streams = max(1, math.ceil(evaluation.batch_size / world_size))
    mem_bytes = _mem_bytes(model, compute_bytes)
    eval_model = dataclasses.replace(
        model, tgt_len=evaluation.tgt_len, mem_len=evaluation.mem_len, same_length=evaluation.same_length
    )
    return [
        _term(
            "evaluation mems (read and written)",
            2 * (model.n_layer + 1) * evaluation.mem_len * eval_streams * model.d_model * mem_bytes,
            "eval",
            f"2 x (n_layer + 1) x eval mem_len {evaluation.mem_len} x {eval_streams} stream(s) x d_model x {mem_bytes}",
        ),
        _term(
            "evaluation forward (one layer)",
            eval_forward_bytes(eval_model, eval_streams, compute_bytes),
            "eval",
            f"{eval_streams} stream(s) x eval tgt_len {evaluation.tgt_len} "
            f"over {evaluation.mem_len + evaluation.tgt_len} keys",
        ),
    ]


def _cpu_process_terms(states: _States, shape: ModelShape) -> list[Term]:
    """On a CPU peak RSS is compared, which holds the process itself and the heap the fp32 build left."""
    terms = [
        _term("process", CPU_PROCESS_BYTES, "steady", "Python, PyTorch, DeepSpeed, gloo (measured on 2 CPU ranks)")
    ]
    if states.stage > 0 or states.mixed:  # DeepSpeed replaces the fp32 tensors the model was built with
        terms.append(
            _term(
                "fp32 build copies kept in the heap",
                shape.heap_sized * FP32 * CPU_HEAP_RETAINED,
                "steady",
                f"{CPU_HEAP_RETAINED} x 4 x parameters in tensors under 32 MiB",
            )
        )
    return terms


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
    largest one that also makes a layout the trainer accepts (`TrainConfig.batch_split`), with its accumulation
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
            layout = cfg.train.batch_split(world_size, candidate)
        except ValueError:
            continue
        return Fit(candidate, layout.grad_accum, largest, plan_memory(cfg, world_size, candidate, device, shape))
    return Fit(None, None, largest, None)
