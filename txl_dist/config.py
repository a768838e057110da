"""The run configuration: one tree of typed dataclasses, built from YAML files and ``key.path=value`` overrides.

Precedence, lowest first::

    dataclass defaults  <  a file's include: list (in order)  <  the file itself
                        <  the next --config file (files are layered left to right)  <  key.path=value overrides

A run config file names its sections; ``include:`` pulls in other files, resolved relative to the including file
and merged in order under it (cycles are refused). ``configs/variants/`` holds one-topic files (ZeRO stage,
precision, offload) meant to be layered this way::

    # configs/lm1b_base.yaml
    include: [variants/bf16.yaml, variants/zero2.yaml]
    model: {preset: lm1b_base}        # a preset from txl_dist.model.PRESETS; the other keys override its fields
    train: {global_batch: 224, max_steps: 500000}

    deepspeed launchers/train.py --config configs/lm1b_base.yaml --config configs/variants/zero3.yaml \\
        data.shards=/data/lm1b/shards train.output_dir=runs/lm1b_z3 train.max_steps=2000

Mappings merge key by key; any other value (lists included) replaces the earlier one. An override's value is read
as YAML: ``train.max_steps=100`` is an int, ``model.cutoffs=[20000,40000]`` a list, ``model.d_embed=null`` None.
Every value is checked against its field's type and range when the tree is built, and the rules that join
sections are checked after; an error is a ``ValueError`` naming the key path, the value given, what is allowed and
where the value was set (file or command line). The vocabulary size comes from the shards' manifest at run time
(`with_manifest_vocab`), so config files normally leave ``model.n_token`` out.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

from txl_dist.model.config import PRESETS, ModelConfig

COMMAND_LINE = "on the command line"


class ConfigError(ValueError):
    """A bad value in the run config; ``key`` is its full path (``train.micro_batch``)."""

    def __init__(self, key: str, value: Any, allowed: str, source: str | None = None) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        where = f" (set {source})" if source else ""
        super().__init__(f"{key}={value!r} is not allowed: {allowed}{where}")

    def with_source(self, source: str | None) -> ConfigError:
        return ConfigError(self.key, self.value, self.allowed, source)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


class _Section:
    """Range checks shared by the sections; the types are checked by `_check_types` before these run."""

    SECTION: ClassVar[str]

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}"

    def _at_least(self, name: str, minimum: int | float, optional: bool = False) -> None:
        value = getattr(self, name)
        if optional and value is None:
            return
        if isinstance(value, int):
            allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        else:
            allowed = f"a number >= {minimum}"
        _require(value >= minimum, self._key(name), value, allowed + (", or null" if optional else ""))

    def _non_empty(self, name: str, optional: bool = False) -> None:
        value = getattr(self, name)
        if optional and value is None:
            return
        _require(value != "", self._key(name), value, "a non-empty string" + (" or null" if optional else ""))

    def validate(self) -> None:
        """Check every field's type (converting where YAML is loose), then its range; ConfigError names the key."""
        _check_types(self, self.SECTION)
        self._check_ranges()

    def _check_ranges(self) -> None:
        raise NotImplementedError


@dataclass
class DataConfig(_Section):
    """Where the token shards are and how they are read. Vocabulary size and special ids come from the manifest."""

    SECTION: ClassVar[str] = "data"

    shards: str | None = None
    """Directory holding the manifest.json written by data_tools.build_shards (the shards themselves may live
    elsewhere: the manifest's shard paths can be ``pipe:`` URLs, e.g. ``pipe:aws s3 cp s3://b/x.tar -``). Required
    to train; usually given on the command line as data.shards=DIR."""
    train_split: str = "train"
    """The manifest split the model trains on."""
    shuffle_blocks: bool = False
    """Permute the split's blocks each epoch (from train.seed) before the split is cut into streams: for corpora
    of independent documents in arbitrary order, such as One Billion Word's shuffled sentences."""
    verify_sha256: bool = True
    """Check every shard's sha256 against the manifest before its tokens are used."""
    tokenizer: str | None = None
    """Tokenizer directory (from data_tools.train_tokenizer); when given, its fingerprint must equal the manifest's,
    so that ids are read with the vocabulary they were written with."""

    def _check_ranges(self) -> None:
        self._non_empty("shards", optional=True)
        self._non_empty("train_split")
        self._non_empty("tokenizer", optional=True)


class BatchLayout(typing.NamedTuple):
    """How one optimizer step's global batch is spread: global_batch = micro_batch * grad_accum * world_size."""

    micro_batch: int
    """Streams per rank per forward pass."""
    grad_accum: int
    """Forward/backward passes per rank per optimizer step."""
    world_size: int


@dataclass
class TrainConfig(_Section):
    """The training run: where it writes, how long it runs, and the batch it steps on."""

    SECTION: ClassVar[str] = "train"

    output_dir: str | None = None
    """Directory of the run: checkpoints, TensorBoard events, the resolved config. Required to train."""
    seed: int = 1111
    """Seed of parameter initialisation, dropout and the per-epoch block order."""
    max_steps: int = 1000
    """Optimizer steps to train for; training stops at the first of max_steps and max_epochs."""
    max_epochs: int | None = None
    """Passes over the training split; null means no limit other than max_steps."""
    global_batch: int = 32
    """Sequences per optimizer step over all ranks: the number S of parallel token streams the training split is
    cut into (DeepSpeed's train_batch_size). The one place the batch size is stated."""
    micro_batch: int | None = None
    """Streams per rank per forward pass; null means global_batch / world_size (no gradient accumulation).
    Gradient accumulation steps = global_batch / (micro_batch * world_size)."""
    memory_check: bool = True
    """On accelerators, refuse to start when the memory plan (`txl_dist.plan`) of a rank needs more than its
    device has, naming a layout that fits; false starts anyway (the plan is within about 10% of measured peaks)."""

    stall_timeout: float = 120.0
    """Seconds after which a rank whose heartbeat has stopped (a stopped process, a hung host, a dead link) is
    named and the job ends with status 1, so that the scheduler can requeue it; keep it well under the collective
    timeout (DEEPSPEED_TIMEOUT, 10 minutes by default)."""

    def _check_ranges(self) -> None:
        self._non_empty("output_dir", optional=True)
        self._at_least("stall_timeout", 5)
        self._at_least("seed", 0)
        self._at_least("max_steps", 1)
        self._at_least("max_epochs", 1, optional=True)
        self._at_least("global_batch", 1)
        self._at_least("micro_batch", 1, optional=True)
        if self.micro_batch is not None:
            _require(
                self.global_batch % self.micro_batch == 0,
                "train.micro_batch",
                self.micro_batch,
                f"a divisor of train.global_batch={self.global_batch}",
            )

    def batch_layout(self, world_size: int, micro_batch: int | None = None) -> BatchLayout:
        """Micro-batch and gradient accumulation for ``world_size`` ranks; ValueError naming the three numbers
        when the global batch does not split evenly. ``micro_batch`` (the memory planner's candidates) replaces
        train.micro_batch. The one place of these rules: the trainer, DeepSpeed's config and the planner use it."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is not allowed: a positive integer")
        if micro_batch is not None:
            return dataclasses.replace(self, micro_batch=micro_batch).batch_layout(world_size)
        if self.micro_batch is None:
            if self.global_batch % world_size:
                raise ValueError(
                    f"train.global_batch={self.global_batch} does not divide among world_size={world_size} ranks "
                    f"(train.micro_batch is null, so each rank would take global_batch / world_size streams); "
                    f"choose a global batch that is a multiple of {world_size}, or set train.micro_batch"
                )
            return BatchLayout(self.global_batch // world_size, 1, world_size)
        per_pass = self.micro_batch * world_size
        if self.global_batch % per_pass:
            raise ValueError(
                f"train.global_batch={self.global_batch} is not a multiple of train.micro_batch={self.micro_batch} "
                f"x world_size={world_size} = {per_pass}, so gradient accumulation steps "
                f"(global_batch / (micro_batch x world_size)) would not be whole; change one of the three"
            )
        return BatchLayout(self.micro_batch, self.global_batch // per_pass, world_size)


@dataclass
class OptimConfig(_Section):
    """The optimizer: torch's fused Adam/AdamW by default, DeepSpeed's FusedAdam on request, DeepSpeed's CPU Adam
    whenever optimizer states are offloaded."""

    SECTION: ClassVar[str] = "optim"

    name: Literal["adamw", "adam"] = "adamw"
    """"adamw": decoupled weight decay; "adam": weight decay added to the gradient (the authors' optimizer; the two
    are the same when weight_decay is 0)."""
    lr: float = 2.5e-4
    """Peak learning rate, reached at the end of warmup."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """Adam's term added to the denominator."""
    weight_decay: float = 0.0
    """Weight decay coefficient (the authors use none)."""
    grad_clip: float = 0.25
    """Maximum global gradient norm (the authors clip at 0.25); 0 disables clipping."""
    implementation: Literal["torch", "deepspeed"] = "torch"
    """Whose Adam: "torch" is torch.optim's Adam/AdamW with ``fused=True`` (one kernel per step on CUDA and CPU,
    nothing to compile); "deepspeed" is DeepSpeed's FusedAdam on accelerators (a CUDA extension that compiles at
    first use, 60-70 s, then cached) and torch's on CPU. With zero.offload_optimizer DeepSpeed's CPU Adam runs
    whatever this says."""

    def _check_ranges(self) -> None:
        _require(self.lr > 0, "optim.lr", self.lr, "a positive number")
        _require(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            "optim.betas",
            self.betas,
            "two numbers in [0, 1)",
        )
        _require(self.eps > 0, "optim.eps", self.eps, "a positive number")
        self._at_least("weight_decay", 0.0)
        self._at_least("grad_clip", 0.0)


SCHEDULE_KINDS = ("cosine", "inv_sqrt", "constant")


@dataclass
class ScheduleConfig(_Section):
    """The learning rate as a function of the optimizer step (see txl_dist.training.schedule for the formulas)."""

    SECTION: ClassVar[str] = "schedule"

    kind: Literal["cosine", "inv_sqrt", "constant"] = "cosine"
    """After warmup: "cosine" anneals from optim.lr to min_lr at total_steps; "inv_sqrt" decays as
    sqrt(warmup_steps / step); "constant" holds optim.lr."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to optim.lr."""
    total_steps: int | None = None
    """Length of the cosine schedule in optimizer steps, warmup included; null means train.max_steps. A run may
    stop before it (train.max_steps) and resume later on the same curve."""
    min_lr: float = 0.0
    """Floor of the decay (the cosine's eta_min; inv_sqrt never goes below it). Must be 0 for "constant"."""

    def _check_ranges(self) -> None:
        self._at_least("warmup_steps", 0)
        self._at_least("total_steps", 1, optional=True)
        self._at_least("min_lr", 0.0)

    def resolved_total_steps(self, max_steps: int) -> int:
        return max_steps if self.total_steps is None else self.total_steps


@dataclass
class PrecisionConfig(_Section):
    """Numeric precision of the forward/backward pass. The memory's storage dtype is model.mem_dtype."""

    SECTION: ClassVar[str] = "precision"

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """"fp32"; "bf16" (DeepSpeed bf16, fp32 master weights); "fp16" (CUDA only; dynamic loss scaling)."""
    initial_scale_power: int = 16
    """fp16 only: the dynamic loss scale starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16 only: steps without overflow before the loss scale doubles."""
    hysteresis: int = 2
    """fp16 only: overflows tolerated before the loss scale is halved."""
    min_loss_scale: int = 1
    """fp16 only: the loss scale never drops below this."""

    def _check_ranges(self) -> None:
        self._at_least("initial_scale_power", 0)
        self._at_least("loss_scale_window", 1)
        self._at_least("hysteresis", 1)
        self._at_least("min_loss_scale", 1)


@dataclass
class ZeroConfig(_Section):
    """DeepSpeed ZeRO data parallelism."""

    SECTION: ClassVar[str] = "zero"

    stage: Literal[0, 1, 2, 3] = 0
    """0: plain data parallelism; 1: partition optimizer states; 2: also gradients; 3: also parameters."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """"cpu": keep optimizer states in host memory and step them with DeepSpeed's CPU Adam (stage 1-3)."""
    bucket_size: int = 200_000_000
    """Elements per gradient-reduction bucket (and per all-gather bucket in stages 1-2): larger overlaps
    communication better and costs memory. The trainer caps it at the model's parameters (rounded up to 512),
    since DeepSpeed allocates the whole bucket at every step."""
    stage3_prefetch_bucket_size: int = 50_000_000
    """Stage 3: elements of parameters fetched ahead of their use."""
    stage3_param_persistence_threshold: int = 100_000
    """Stage 3: parameters with fewer elements stay whole on every rank instead of being partitioned."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Stage 3: most gathered parameter elements held at once on a rank."""

    def _check_ranges(self) -> None:
        self._at_least("bucket_size", 1)
        self._at_least("stage3_prefetch_bucket_size", 0)
        self._at_least("stage3_param_persistence_threshold", 0)
        self._at_least("stage3_max_live_parameters", 1)


@dataclass
class EvalConfig(_Section):
    """Periodic evaluation on a held-out split. Segment settings left null take the model's."""

    SECTION: ClassVar[str] = "eval"

    every: int = 1000
    """Evaluate every this many optimizer steps and at the end of training; 0 evaluates only at the end."""
    split: str = "valid"
    """The manifest split evaluated."""
    tgt_len: int | None = None
    """Tokens per evaluation segment; null means model.tgt_len."""
    mem_len: int | None = None
    """Memory length during evaluation; null means model.mem_len."""
    clamp_len: int | None = None
    """Relative distances beyond this share one encoding; <= 0 disables; null means model.clamp_len."""
    same_length: bool | None = None
    """Every query attends to the same number of keys (the paper's evaluation); null means model.same_length."""
    batch_size: int = 10
    """Streams the evaluation split is cut into, over all ranks."""
    max_batches: int = 0
    """Segments per stream to evaluate during training; 0 evaluates the whole split. The best checkpoint is
    tracked over whole-split passes only (the final one always is), since samples score different tokens."""

    def _check_ranges(self) -> None:
        self._at_least("every", 0)
        self._non_empty("split")
        self._at_least("tgt_len", 1, optional=True)
        self._at_least("mem_len", 0, optional=True)
        self._at_least("batch_size", 1)
        self._at_least("max_batches", 0)

    def resolve(self, model: ModelConfig) -> EvalConfig:
        """A copy with every null segment setting replaced by the model's."""
        resolved = {
            name: getattr(model, name) if getattr(self, name) is None else getattr(self, name)
            for name in ("tgt_len", "mem_len", "clamp_len", "same_length")
        }
        return dataclasses.replace(self, **resolved)


@dataclass
class CheckpointConfig(_Section):
    """Checkpoints under train.output_dir."""

    SECTION: ClassVar[str] = "checkpoint"

    every: int = 1000
    """Save every this many optimizer steps and at the end of training (0: only at the end), and whenever a full
    validation pass improves on the best so far; SIGTERM/SIGINT also save."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted once a newer one is complete); 0 keeps all."""
    resume: bool = True
    """Continue from the newest complete checkpoint in train.output_dir that verifies, when there is one."""
    verify: bool = True
    """Check every file of a checkpoint against the sizes and CRC-32s of its COMPLETE.json before resuming from it,
    and skip those that fail. false trusts the newest complete checkpoint as it is (the log says so)."""

    def _check_ranges(self) -> None:
        self._at_least("every", 0)
        self._at_least("keep_last", 0)


@dataclass
class LogConfig(_Section):
    """Console and TensorBoard logging, from rank 0."""

    SECTION: ClassVar[str] = "log"

    every: int = 100
    """Log training scalars every this many optimizer steps."""
    tensorboard: bool = True
    """Write TensorBoard events under train.output_dir/tensorboard."""

    def _check_ranges(self) -> None:
        self._at_least("every", 1)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "precision": PrecisionConfig,
    "zero": ZeroConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}
"""The sections of a run config file, in the order they are printed."""

PRESET_KEY = "preset"


@dataclass
class RunConfig:
    """A whole training run. Each component receives its own section (``cfg.optim``), never this object."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture; n_token is replaced by the manifest's vocabulary size at run time."""
    model_preset: str | None = None
    """The preset the model section started from (``model: {preset: NAME}``), kept for the record."""
    data: DataConfig = field(default_factory=DataConfig)
    """Shards and how they are read."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Output directory, length of the run, batch sizes."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and gradient clipping."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """fp32, bf16 or fp16."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and offload."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint frequency, retention, resume."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging frequency and TensorBoard."""
    key_sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where each key path was last set ("in configs/x.yaml", "on the command line"), for error messages and
    for telling a value that was given from a default. Not part of the configuration itself."""

    def validate(self) -> RunConfig:
        """Check every section and the rules that join sections; ConfigError names the key and where it was set."""
        try:
            _check_types(self.model, "model")
            model = self.model
            if "model.n_token" not in self.key_sources and model.cutoffs and model.cutoffs[-1] >= model.n_token:
                # The vocabulary size comes from the shards' manifest at run time (with_manifest_vocab checks
                # the cutoffs against it then); a preset's placeholder n_token must not reject them now.
                model = dataclasses.replace(model, n_token=model.cutoffs[-1] + 1)
            model.validate()
        except ConfigError as error:
            raise error.with_source(self.key_sources.get(error.key)) from None
        except ValueError as error:
            # ModelConfig's messages start with "model.<field>=".
            key = str(error).split("=", 1)[0]
            source = self.key_sources.get(key)
            raise ValueError(f"{error} (set {source})" if source else str(error)) from None
        try:
            for name in list(SECTIONS)[1:]:
                getattr(self, name).validate()
            self._validate_across_sections()
        except ConfigError as error:
            raise error.with_source(self.key_sources.get(error.key)) from None
        return self

    def _validate_across_sections(self) -> None:
        schedule = self.schedule
        total = schedule.resolved_total_steps(self.train.max_steps)
        total_name = "train.max_steps" if schedule.total_steps is None else "schedule.total_steps"
        _require(
            schedule.warmup_steps <= total,
            "schedule.warmup_steps",
            schedule.warmup_steps,
            f"at most the schedule's length, {total_name}={total}",
        )
        if schedule.kind == "constant":
            _require(
                schedule.min_lr == 0,
                "schedule.min_lr",
                schedule.min_lr,
                "0 with schedule.kind='constant' (a constant schedule never decays)",
            )
        _require(
            schedule.min_lr <= self.optim.lr, "schedule.min_lr", schedule.min_lr, f"at most optim.lr={self.optim.lr}"
        )
        if self.zero.offload_optimizer != "none":
            _require(
                self.zero.stage >= 1,
                "zero.offload_optimizer",
                self.zero.offload_optimizer,
                "'none' with zero.stage=0 (DeepSpeed offloads ZeRO-partitioned optimizer states: "
                "use zero.stage 1, 2 or 3)",
            )
        evaluation = self.eval.resolve(self.model)
        if evaluation.same_length:
            _require(
                evaluation.mem_len > 0,
                "eval.same_length",
                True,
                "false when the evaluation mem_len is 0 (every query would see no key)",
            )

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, sections in order; `from_dict` rebuilds an equal config."""
        data: dict[str, Any] = {"model": {PRESET_KEY: self.model_preset, **self.model.to_dict()}}
        for name in list(SECTIONS)[1:]:
            data[name] = dataclasses.asdict(getattr(self, name))
        return data

    def dump_yaml(self) -> str:
        """The resolved config as YAML (``--print-config``; stored with checkpoints); loads back to an equal one."""
        return yaml.dump(self.to_dict(), Dumper=_ConfigDumper, sort_keys=False, width=120)

    @classmethod
    def from_dict(cls, data: Any, where: str = "a config dict") -> RunConfig:
        """Build and validate a config from plain data such as `to_dict` gives (e.g. a checkpoint's)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a run config must be a mapping of sections, got {type(data).__name__}")
        return _build(data, {path: f"in {where}" for path in _key_paths(data)})


class _ConfigDumper(yaml.SafeDumper):
    """Block-style sections with lists on one line (``cutoffs: [60000, 100000]``), as people write them."""


_ConfigDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def with_manifest_vocab(cfg: RunConfig, vocab_size: int, manifest_where: str) -> RunConfig:
    """The config with model.n_token = the manifest's vocabulary size.

    A config that set model.n_token itself (a file, the command line, a checkpoint's config) must agree with the
    manifest; a preset's or the default's value is simply replaced. The model is re-validated (the adaptive
    softmax cutoffs must lie inside the vocabulary)."""
    source = cfg.key_sources.get("model.n_token")
    if source is not None and cfg.model.n_token != vocab_size:
        raise ValueError(
            f"model.n_token={cfg.model.n_token} (set {source}) disagrees with {manifest_where}: vocab_size "
            f"{vocab_size}; leave model.n_token out of the config to take it from the manifest"
        )
    model = dataclasses.replace(cfg.model, n_token=vocab_size)
    try:
        model.validate()
    except ValueError as error:
        raise ValueError(f"{error} (with n_token={vocab_size} from {manifest_where})") from None
    sources = {**cfg.key_sources, "model.n_token": f"in {manifest_where}"}
    return dataclasses.replace(cfg, model=model, key_sources=sources)


def load_config(
    paths: str | os.PathLike | Sequence[str | os.PathLike] | None, overrides: Sequence[str] = ()
) -> RunConfig:
    """Build the run config: defaults, then each file in ``paths`` (with its includes) left to right, then the
    ``key.path=value`` overrides. Raises ValueError naming the key, the value, what is allowed and its source."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for path in paths:
        data, data_sources = _read_config_file(Path(path), ())
        merge_mappings(merged, data)
        sources.update(data_sources)
    for override in overrides:
        data = _parse_override(override)
        merge_mappings(merged, data)
        sources.update({path: COMMAND_LINE for path in _key_paths(data)})
    return _build(merged, sources)


# --- building the tree ------------------------------------------------------------------------------------------


def _build(data: dict[str, Any], sources: dict[str, str]) -> RunConfig:
    # An empty section (``eval:`` with every key commented out) reads as null: it means the defaults.
    data = {section: {} if value is None else value for section, value in data.items()}
    for section, value in data.items():
        if section not in SECTIONS:
            raise ValueError(
                f"unknown section {section!r} {sources.get(str(section), '')}".rstrip()
                + f"; allowed sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(value, dict):
            raise ConfigError(section, value, f"a mapping of {section} keys", sources.get(section))
    sections: dict[str, Any] = {}
    model_data = dict(data.get("model", {}))
    preset_name = model_data.pop(PRESET_KEY, None)
    if preset_name is not None and (not isinstance(preset_name, str) or preset_name not in PRESETS):
        raise ConfigError("model.preset", preset_name, f"null or one of {sorted(PRESETS)}", sources.get("model.preset"))
    for name, cls in SECTIONS.items():
        values = model_data if name == "model" else data.get(name, {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in values if key not in names]
        if unknown:
            key = f"{name}.{unknown[0]}"
            allowed = ([PRESET_KEY] if name == "model" else []) + names
            raise ValueError(
                f"unknown key {key!r} {sources.get(key, '')}".rstrip()
                + f"; allowed keys in {name}: {', '.join(allowed)}"
            )
        try:
            values = _typed_values(cls, copy.deepcopy(values), name)
        except ConfigError as error:
            raise error.with_source(sources.get(error.key)) from None
        if name == "model" and preset_name is not None:
            values = {**PRESETS[preset_name], **values}
        sections[name] = cls(**values)
    return RunConfig(**sections, model_preset=preset_name, key_sources=sources).validate()


def _check_types(section: Any, section_name: str) -> None:
    """Check every field of a section instance against its annotation (see `_typed_values`)."""
    values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    for name, value in _typed_values(type(section), values, section_name).items():
        setattr(section, name, value)


def _typed_values(cls: type, values: dict[str, Any], section_name: str) -> dict[str, Any]:
    """``values`` checked against the annotations of ``cls``'s fields, converted where YAML is loose (an int or
    a numeric string for a float: PyYAML reads ``1e-3`` as a string)."""
    hints = typing.get_type_hints(cls)
    typed = {}
    for name, value in values.items():
        try:
            typed[name] = _coerce(value, hints[name])
        except _Mismatch:
            raise ConfigError(f"{section_name}.{name}", value, _describe(hints[name])) from None
    return typed


class _Mismatch(Exception):
    """A value that does not fit a field's type (turned into a ConfigError describing the whole type)."""


def _coerce(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        return [_coerce(item, args[0]) for item in value]
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise _Mismatch
        return value
    if hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise _Mismatch from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _Mismatch
        return float(value)
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint in (bool, str):
        ok = isinstance(value, hint)
    else:
        raise TypeError(f"unsupported config field type {hint!r}")
    if not ok:
        raise _Mismatch
    return value


_SCALAR_NAMES = {
    bool: ("a boolean (true or false)", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string (quote it if it looks like a number)", "strings"),
}


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return f"{_describe(inner)}, or null"
    if origin is list:
        return f"a list of {_SCALAR_NAMES[args[0]][1]}"
    if origin is Literal:
        return f"one of {list(args)}"
    return _SCALAR_NAMES[hint][0]


# --- reading files and overrides --------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_config_file(path: Path, including: tuple[Path, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """A file's data merged over its includes, and where each key path was set."""
    shown = os.path.normpath(path)
    resolved = path.resolve()
    if resolved in including:
        chain = " -> ".join([os.path.normpath(p) for p in including] + [shown])
        raise ValueError(f"include cycle: {chain}")
    if not path.is_file():
        parent = f" (included from {os.path.normpath(including[-1])})" if including else ""
        raise ValueError(f"{shown}: no such config file{parent}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"{shown}: not valid YAML: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{shown}: the top level must be a mapping of sections, got {type(data).__name__}")
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(item, str) for item in includes):
        raise ValueError(
            f"{shown}: include={includes!r} is not allowed: a path or a list of paths (relative to {shown})"
        )
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in includes:
        included, included_sources = _read_config_file(path.parent / item, including + (resolved,))
        merge_mappings(merged, included)
        sources.update(included_sources)
    merge_mappings(merged, data)
    sources.update({key: f"in {shown}" for key in _key_paths(data)})
    return merged, sources


def _parse_override(text: str) -> dict[str, Any]:
    """``section.key=value`` (value read as YAML) as nested data; a whole section may be given as a mapping."""
    key, sep, raw_value = text.partition("=")
    parts = key.split(".")
    if not sep or not all(parts) or len(parts) > 2:
        raise ValueError(f"override {text!r} is not section.key=value (e.g. train.max_steps=100)")
    try:
        value = yaml.safe_load(raw_value)
    except yaml.YAMLError as error:
        raise ValueError(f"override {text!r}: the value is not valid YAML: {error}") from None
    return {parts[0]: value} if len(parts) == 1 else {parts[0]: {parts[1]: value}}


def merge_mappings(into: dict[str, Any], data: dict[str, Any]) -> None:
    """Merge ``data`` over ``into`` in place: mappings key by key, any other value replaces (a copy of it)."""
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge_mappings(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _key_paths(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key path in nested data, mappings included (``train``, ``train.max_steps``)."""
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        paths.append(path)
        if isinstance(value, dict):
            paths.extend(_key_paths(value, path + "."))
    return paths
