"""The sections of the run config other than the model's: data, train, optim, schedule, precision, zero, eval,
checkpoint, numerics, log, profile. Each field's type, range and meaning are declared once
(`txl_dist.config.fields`)."""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import field
from typing import Annotated, ClassVar, Literal

import pydantic
from pydantic import Field

from txl_dist.config.fields import (
    NOT_A_BOOLEAN,
    TUPLE_AS_LIST,
    Allowed,
    ConfigError,
    Integer,
    NonEmpty,
    NonNegative,
    NonNegativeNumber,
    Number,
    Positive,
    PositiveNumber,
    config_dataclass,
)
from txl_dist.config.model import MODEL_FIELD_ROLES, ModelConfig

SEED_MAX = 2**32 - 1
PeakTflops = Annotated[
    Number, Field(ge=1e-3, le=1e5), Allowed("a positive number, or null: from 0.001 TFLOPS (a slow CPU core) to 100000")
]


@config_dataclass
class DataConfig:
    """Where the token shards are and how they are read. Vocabulary size and special ids come from the manifest."""

    SECTION: ClassVar[str] = "data"

    shards: NonEmpty | None = None
    """Directory holding the manifest.json written by data_tools.build_shards (the shards themselves may live
    elsewhere: the manifest's shard paths can be ``pipe:`` URLs, e.g. ``pipe:aws s3 cp s3://b/x.tar -``). Required
    to train; usually given on the command line as data.shards=DIR."""
    train_split: NonEmpty = "train"
    """The manifest split the model trains on."""
    shuffle_blocks: bool = False
    """Permute the split's blocks each epoch (from train.seed) before the split is cut into streams: for corpora
    of independent documents in arbitrary order, such as One Billion Word's shuffled sentences."""
    verify_sha256: bool = True
    """Check every shard's sha256 against the manifest before its tokens are used."""
    tokenizer: NonEmpty | None = None
    """Tokenizer directory (from data_tools.train_tokenizer); when given, its fingerprint must equal the manifest's,
    so that ids are read with the vocabulary they were written with."""


class BatchSplit(typing.NamedTuple):
    """How one optimizer step's global batch is spread: global_batch = micro_batch * grad_accum * world_size."""

    micro_batch: int
    """Streams per rank per forward pass."""
    grad_accum: int
    """Forward/backward passes per rank per optimizer step."""
    world_size: int


@config_dataclass
class TrainConfig:
    """The training run: where it writes, how long it runs, and the batch it steps on."""

    SECTION: ClassVar[str] = "train"

    output_dir: NonEmpty | None = None
    """Directory of the run: checkpoints, TensorBoard events, the resolved config. Required to train."""
    init_from: NonEmpty | None = None
    """A trained model to start from (fine-tuning): an export folder, a training run or one of its checkpoints
    (any ZeRO stage and world size), a transformers TransfoXL folder, a folder of export-to-hub, the authors'
    state dict (a .pt with config.json beside it) or the authors' TensorFlow release. The run starts with its
    weights and a fresh optimizer, schedule, step count and data position; its architecture is the model's (a
    model key that would change a weight's shape is refused); its shards must be built with the model's tokenizer.
    A rerun resumes from the run's own checkpoints. docs/fine-tuning.md."""
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] = 1111
    """Seed of parameter initialisation, dropout and the per-epoch block order: 0 to 2**32 - 1, the seeds that
    every generator involved takes (numpy's, and torch's once each rank and step is added to it)."""
    max_steps: Positive = 1000
    """Optimizer steps to train for; training stops at the first of max_steps and max_epochs."""
    max_epochs: Positive | None = None
    """Passes over the training split; null means no limit other than max_steps."""
    global_batch: Positive = 32
    """Sequences per optimizer step over all ranks: the number S of parallel token streams the training split is
    cut into (DeepSpeed's train_batch_size). The one place the batch size is stated."""
    micro_batch: Positive | None = None
    """Streams per rank per forward pass; null means global_batch / world_size (no gradient accumulation).
    Gradient accumulation steps = global_batch / (micro_batch * world_size)."""
    memory_check: bool = True
    """On accelerators, refuse to start when the memory plan (`txl_dist.plan`) of a rank needs more than its
    device has, naming a layout that fits; false starts anyway (the plan is an estimate, which
    benchmarks/plan_check.py compares with measured peaks)."""

    stall_timeout: Annotated[Number, Field(ge=5)] = 120.0
    """Seconds after which a rank whose heartbeat has stopped (a stopped process, a hung host, a dead link) is
    named and the job ends with status 1, so that the scheduler can requeue it; keep it well under the collective
    timeout (DEEPSPEED_TIMEOUT, 10 minutes by default)."""
    peak_tflops: PeakTflops | None = None
    """The accelerator's peak for the run's dtype, in TFLOPS per device (one rank), against which the log's MFU
    is taken; null means the known peak of the device (`txl_dist.training.throughput.PEAK_TFLOPS`: A100, H100,
    H200, B200, dense), or no MFU where none is known (a CPU). An MFU above 100% (a peak set below what the run
    achieves) is said once in the log."""

    @pydantic.model_validator(mode="after")
    def _micro_batch_divides(self) -> TrainConfig:
        if self.micro_batch is not None and self.global_batch % self.micro_batch:
            raise ConfigError(
                "train.micro_batch", self.micro_batch, f"a divisor of train.global_batch={self.global_batch}"
            )
        return self

    def splits_over(self, world_size: int, micro_batch: int | None = None) -> bool:
        """Whether ``world_size`` ranks of ``micro_batch`` streams per pass (default train.micro_batch; null: one)
        split the global batch into whole accumulation steps."""
        per_rank = (self.micro_batch if micro_batch is None else micro_batch) or 1
        return self.global_batch % (per_rank * world_size) == 0

    def micro_batch_problem(self, micro_batch: int) -> str:
        """Why a micro-batch fits no world size: larger than the global batch, or not one of its divisors."""
        divisors = ", ".join(str(d) for d in range(1, self.global_batch + 1) if self.global_batch % d == 0)
        if micro_batch > self.global_batch:
            why = f"the micro-batch {micro_batch} is larger than the global batch {self.global_batch}"
        else:
            why = f"the micro-batch {micro_batch} does not divide the global batch {self.global_batch}"
        return f"{why}; the micro-batches that divide it: {divisors}"

    def batch_split(self, world_size: int, micro_batch: int | None = None) -> BatchSplit:
        """Micro-batch and gradient accumulation for ``world_size`` ranks; ValueError naming the three numbers
        when the global batch does not split evenly. ``micro_batch`` (the memory planner's candidates) replaces
        train.micro_batch. The one place of these rules: the trainer, DeepSpeed's config and the planner use it."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is not allowed: a positive integer")
        micro_batch = self.micro_batch if micro_batch is None else micro_batch
        per_rank = micro_batch or 1
        per_pass = per_rank * world_size
        if self.global_batch % per_pass:
            holding = [
                str(size) for size in range(1, self.global_batch // per_rank + 1) if self.splits_over(size, per_rank)
            ]
            given = f"train.micro_batch={micro_batch}" if micro_batch else "train.micro_batch null (no accumulation)"
            which = (
                f"the world sizes that can hold it are {', '.join(holding)}; the global batch stays as it is (it fixes "
                f"the streams and their order), so run on one of those, or change train.micro_batch"
                if holding
                else f"no world size can hold it: {self.micro_batch_problem(per_rank)}"
            )
            raise ValueError(
                f"train.global_batch={self.global_batch} with {given} cannot be split over {world_size} ranks "
                f"(global_batch / (micro_batch x world_size) accumulation steps must be whole): {which}"
            )
        if micro_batch is None:
            return BatchSplit(self.global_batch // world_size, 1, world_size)
        return BatchSplit(micro_batch, self.global_batch // per_pass, world_size)


@config_dataclass
class OptimConfig:
    """The optimizer: torch's fused Adam/AdamW by default, DeepSpeed's FusedAdam on request, DeepSpeed's CPU Adam
    whenever optimizer states are offloaded."""

    SECTION: ClassVar[str] = "optim"

    name: Literal["adamw", "adam"] = "adamw"
    """"adamw": decoupled weight decay; "adam": weight decay added to the gradient (the authors' optimizer; the two
    are the same when weight_decay is 0)."""
    lr: PositiveNumber = 2.5e-4
    """Peak learning rate, reached at the end of warmup."""
    betas: Annotated[list[Number], TUPLE_AS_LIST] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's decay rates of the first and second moment estimates."""
    eps: PositiveNumber = 1e-8
    """Adam's term added to the denominator."""
    weight_decay: NonNegativeNumber = 0.0
    """Weight decay coefficient (the authors use none)."""
    grad_clip: NonNegativeNumber = 0.25
    """Maximum global gradient norm (the authors clip at 0.25); 0 disables clipping."""
    implementation: Literal["torch", "deepspeed"] = "torch"
    """Whose Adam: "torch" is torch.optim's Adam/AdamW with ``fused=True`` (one kernel per step on CUDA and CPU,
    nothing to compile); "deepspeed" is DeepSpeed's FusedAdam on accelerators (a CUDA extension that compiles at
    first use, then cached) and torch's on CPU. With zero.offload_optimizer DeepSpeed's CPU Adam runs
    whatever this says."""

    @pydantic.field_validator("betas")
    @classmethod
    def _two_decay_rates(cls, betas: list[float]) -> list[float]:
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError("optim.betas", betas, "two numbers in [0, 1)")
        return betas


@config_dataclass
class ScheduleConfig:
    """The learning rate as a function of the optimizer step (see txl_dist.training.schedule for the formulas)."""

    SECTION: ClassVar[str] = "schedule"

    kind: Literal["cosine", "inv_sqrt", "constant"] = "cosine"
    """After warmup: "cosine" anneals from optim.lr to min_lr at total_steps; "inv_sqrt" decays as
    sqrt(warmup_steps / step); "constant" holds optim.lr."""
    warmup_steps: NonNegative = 0
    """Steps of linear warmup from 0 to optim.lr."""
    total_steps: Positive | None = None
    """Length of the cosine schedule in optimizer steps, warmup included; null means train.max_steps. A run may
    stop before it (train.max_steps) and resume later on the same curve."""
    min_lr: NonNegativeNumber = 0.0
    """Floor of the decay (the cosine's eta_min; inv_sqrt never goes below it). Must be 0 for "constant"."""

    def resolved_total_steps(self, max_steps: int) -> int:
        return max_steps if self.total_steps is None else self.total_steps


@config_dataclass
class PrecisionConfig:
    """Numeric precision of the forward/backward pass. The memory's storage dtype is model.mem_dtype."""

    SECTION: ClassVar[str] = "precision"

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """"fp32"; "bf16" (DeepSpeed bf16, fp32 master weights); "fp16" (CUDA only; dynamic loss scaling)."""
    initial_scale_power: Annotated[int, Field(ge=0, le=127)] = 16
    """fp16 only: the dynamic loss scale starts at 2**initial_scale_power (at most 2**127, which float32 holds)."""
    loss_scale_window: Positive = 1000
    """fp16 only: steps without overflow before the loss scale doubles."""
    hysteresis: Positive = 2
    """fp16 only: overflows tolerated before the loss scale is halved."""
    min_loss_scale: Positive = 1
    """fp16 only: the loss scale never drops below this."""


@config_dataclass
class ZeroConfig:
    """DeepSpeed ZeRO data parallelism."""

    SECTION: ClassVar[str] = "zero"

    stage: Annotated[Literal[0, 1, 2, 3], NOT_A_BOOLEAN] = 0
    """0: plain data parallelism; 1: partition optimizer states; 2: also gradients; 3: also parameters."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """"cpu": keep optimizer states in host memory and step them with DeepSpeed's CPU Adam (stage 1-3)."""
    bucket_size: Positive = 200_000_000
    """Elements per gradient-reduction bucket (and per all-gather bucket in stages 1-2): larger overlaps
    communication better and costs memory. The trainer caps it at the model's parameters (rounded up to 512),
    since DeepSpeed allocates the whole bucket at every step."""
    stage3_prefetch_bucket_size: NonNegative = 50_000_000
    """Stage 3: elements of parameters fetched ahead of their use."""
    stage3_param_persistence_threshold: NonNegative = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank instead of being partitioned."""
    stage3_max_live_parameters: Positive = 1_000_000_000
    """Stage 3: most gathered parameter elements held at once on a rank."""


# Bucket sizes are multiples of this many elements (DeepSpeed asserts a multiple of its NCCL start alignment).
BUCKET_ALIGNMENT = 512


def bucket_elements(zero: ZeroConfig, num_parameters: int | None) -> int:
    """Elements of DeepSpeed's gradient-reduction (and stage 1-2 all-gather) buckets: ``zero.bucket_size``, at
    most the model's parameters.

    DeepSpeed allocates its reduction bucket whole at every step (ZeRO 1-2: ``torch.empty(reduce_bucket_size)``
    in ``setup_buckets``), however few gradients it will hold. A GPU's caching allocator hands the same block
    back, but it stays reserved: 800 MB of fp32 for the default 200M elements, around a 2M-parameter model. On
    a CPU each step maps that much fresh memory and takes a page fault for every 4 KiB the gradients touch,
    which the kernel zero-fills, thousands of faults per step of a small model. A bucket the size
    of the model holds every gradient, so a larger one only costs this. The cap is rounded up to a multiple of
    `BUCKET_ALIGNMENT` elements: DeepSpeed wants bucket sizes aligned for its collectives."""
    if num_parameters is None:
        return zero.bucket_size
    return min(zero.bucket_size, -(-max(1, num_parameters) // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT)


@config_dataclass
class EvalConfig:
    """Periodic evaluation on a held-out split. Segment settings left null take the model's."""

    SECTION: ClassVar[str] = "eval"

    every: NonNegative = 1000
    """Evaluate every this many optimizer steps and at the end of training; 0 evaluates only at the end."""
    split: NonEmpty = "valid"
    """The manifest split evaluated."""
    tgt_len: Positive | None = None
    """Tokens per evaluation segment; null means model.tgt_len."""
    mem_len: NonNegative | None = None
    """Memory length during evaluation; null means model.mem_len."""
    clamp_len: Integer | None = None
    """Relative distances beyond this share one encoding; <= 0 disables; null means model.clamp_len."""
    same_length: bool | None = None
    """Every query attends to the same number of keys (the paper's evaluation); null means model.same_length."""
    batch_size: Positive = 10
    """Streams the evaluation split is cut into, over all ranks."""
    max_batches: NonNegative = 0
    """Segments per stream to evaluate during training; 0 evaluates the whole split. The best checkpoint is
    tracked over whole-split passes only (the final one always is), since samples score different tokens."""

    def resolve(self, model: ModelConfig) -> EvalConfig:
        """A copy with every null segment setting replaced by the model's."""
        resolved = {
            name: getattr(model, name) if getattr(self, name) is None else getattr(self, name)
            for name in EVAL_SEGMENT_FIELDS
        }
        return dataclasses.replace(self, **resolved)


EVAL_SEGMENT_FIELDS = tuple(f.name for f in dataclasses.fields(EvalConfig) if f.name in MODEL_FIELD_ROLES.segment)
"""The segment settings of the model (role SEGMENT) that the eval section may set; null takes the model's."""


@config_dataclass
class CheckpointConfig:
    """Checkpoints under train.output_dir."""

    SECTION: ClassVar[str] = "checkpoint"

    every: NonNegative = 1000
    """Save every this many optimizer steps and at the end of training (0: only at the end), and whenever a full
    validation pass improves on the best so far; SIGTERM/SIGINT also save."""
    every_minutes: NonNegativeNumber | None = None
    """Also save once this many minutes of wall-clock time have passed since the last save (or the start), so that
    the work a fault can lose is bounded in time whatever the step time; 0 or null: no clock cadence. Rank 0's
    clock decides and every rank saves at the same step."""
    keep_last: NonNegative = 2
    """Checkpoints kept (older ones are deleted once a newer one is complete); 0 keeps all."""
    resume: bool = True
    """Continue from the newest complete checkpoint in train.output_dir that verifies, when there is one."""
    verify: bool = True
    """Check every file of a checkpoint against the sizes and CRC-32s of its COMPLETE.json before resuming from it,
    and skip those that fail. false trusts the newest complete checkpoint as it is (the log says so)."""
    memory_every: NonNegative = 0
    """Every this many optimizer steps, a snapshot of every rank's whole training state in the memory of its node
    and of the next node (checkpoint.memory_dir), so that a fault costs at most this many steps: a relaunch
    resumes from the newest snapshot that every rank left somewhere, when it is newer than the newest checkpoint
    (`txl_dist.checkpoints.snapshots`). Costs node memory for two snapshots of each rank and of its neighbour's.
    0: none."""
    memory_dir: str = "/dev/shm"
    """Where the memory snapshots go on each node: a memory-backed folder local to the node (a tmpfs; a run warns
    when it is not), as an absolute path; a leading ``~`` is expanded as a shell would."""
    background: bool = False
    """Write checkpoints while training goes on: each save copies the state into host memory (training waits for
    that copy only) and a thread writes and checks the files; the checkpoint is complete, and resumable, once
    every rank's write has ended, a step or more later. At most one write is in flight. Costs host memory for one
    copy of the rank's state (`txl_dist.checkpoints.background`)."""

    @pydantic.field_validator("memory_dir")
    @classmethod
    def _absolute_memory_dir(cls, memory_dir: str) -> str:
        expanded = os.path.expanduser(memory_dir)
        if not os.path.isabs(expanded) or "\x00" in expanded:
            raise ConfigError(
                "checkpoint.memory_dir",
                memory_dir,
                "an absolute path of each node's memory-backed folder, such as /dev/shm ('~' is expanded; a relative "
                "path would depend on where the command starts)",
            )
        return os.path.normpath(expanded)


@config_dataclass
class NumericsConfig:
    """The run's own numbers watched (`txl_dist.training.numerics`; docs/recovery.md, Numerical faults): every step
    the ranks agree, in the collective that already ends it, whether its loss and gradient norm are finite and the
    loss is no spike. A step that fails is never saved: the ranks roll back in the same process to the newest
    healthy state (the newest memory snapshot, else the newest checkpoint that verifies) and replay; a fault that
    comes back at the same step skips the data window since that state, recorded so that every resume skips it
    too."""

    SECTION: ClassVar[str] = "numerics"

    check: bool = True
    """Judge every step and roll back on a fault. false: train on whatever the numbers (a checkpoint still records
    its step's loss, and a resume or rotation still passes over one whose loss was not finite)."""
    max_loss: PositiveNumber | None = None
    """A step whose loss (nats per token) is above this is a fault whatever the steps before it; null: 3 x
    ln(model.n_token), three times worse than guessing uniformly, which no model training as it should comes
    near (its first steps sit at about ln(n_token)), and which a diverged one passes at once."""
    spike_window: NonNegative = 100
    """Healthy steps of loss history the spike detector keeps (saved with every checkpoint); it judges once it
    holds 10 of them (or all of a shorter window). 0: no spike detection (non-finite values are still faults)."""
    spike_threshold: PositiveNumber = 8.0
    """A step's loss is a spike when it lies more than this many robust deviations (1.4826 x the median absolute
    deviation of the window) above the window's median..."""
    spike_min_rise: NonNegativeNumber = 0.15
    """... and more than this fraction of the median above it (0.15: 15% higher), so that a window of nearly equal
    losses does not call an ordinary wobble a spike."""
    max_rollbacks: NonNegative = 16
    """Rollbacks this start of the run may make in all; past it the run stops (exit status 4, which the Slurm batch
    script never retries). 0: stop at the first fault, keeping the newest healthy checkpoint."""
    max_rollbacks_per_window: Positive = 2
    """Rollbacks to the same healthy state for a fault at the same step: the first replays the steps since that
    state (a transient fault passes), each later one skips their data (a fault in the data passes); past it the
    run stops."""
    lr_factor_after_skip: Annotated[Number, Field(gt=0, le=1), Allowed("a factor in (0, 1]")] = 1.0
    """The learning rate's peak (optim.lr) is multiplied by this after each skip of a data window, and stays so
    (the schedule's floor, schedule.min_lr, stays); 1: unchanged."""


@config_dataclass
class LogConfig:
    """Console and TensorBoard logging, from rank 0."""

    SECTION: ClassVar[str] = "log"

    every: Positive = 100
    """Log training scalars every this many optimizer steps."""
    tensorboard: bool = True
    """Write TensorBoard events under train.output_dir/tensorboard."""


@config_dataclass
class ProfileConfig:
    """A profile of chosen steps with torch.profiler (`txl_dist.training.profiling`; docs/profiling.md)."""

    SECTION: ClassVar[str] = "profile"

    steps: Annotated[list[Positive], TUPLE_AS_LIST] | None = None
    """[A, B]: record optimizer steps A to B (both included; the first step of a run is 1) on every rank, into a
    Chrome trace per rank under train.output_dir/profile, with the loop's phases labelled (data, forward,
    backward, gradient reduction, optimizer step, checkpoint, evaluation). null: no profiler, and none of its
    cost, at any step."""
    record_shapes: bool = False
    """Record each operator's input shapes in the trace (larger traces)."""
    with_stack: bool = False
    """Record the Python stack of each operator (much larger traces; slows the profiled steps)."""
    memory_history: bool = False
    """CUDA: record every allocation's stack from the start of the run, so that the memory snapshot an
    out-of-memory error writes shows where each block came from (costs a few percent of step time). Without it
    the snapshot holds the allocator's segments only."""

    @pydantic.model_validator(mode="after")
    def _check_steps(self) -> ProfileConfig:
        if self.steps is not None and (len(self.steps) != 2 or self.steps[1] < self.steps[0]):
            raise ConfigError(
                "profile.steps", self.steps, "null or [A, B], the first and last optimizer step to profile, 1 <= A <= B"
            )
        return self
