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

Mappings merge key by key; any other value (lists included) replaces the earlier one. A section left empty
(``train:`` with its keys commented out, or ``train=null``) changes nothing; a section given as anything but a
mapping is refused, naming the file or the command line. An override's value is read
as YAML: ``train.max_steps=100`` is an int, ``model.cutoffs=[20000,40000]`` a list, ``model.d_embed=null`` None.
Every value is checked against its field's type and range when its section is made, and the rules that join
sections after (pydantic, see `txl_dist.config.fields`); an error is a ``ValueError`` naming the key path, the value
given, what is allowed and where the value was set (file or command line). The vocabulary size comes from the
shards' manifest at run time (`with_manifest_vocab`), so config files normally leave ``model.n_token`` out.

The sections are declared in `txl_dist.config.sections` (the model's in `txl_dist.config.model`), the files and
overrides read by `txl_dist.config.files`.

Layer 1 (docs/architecture.md, Layers): may import layer 1; today it imports nothing of txl_dist outside itself:
nothing of the data, the model or torch, so that every command loads a config at once.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import field
from typing import Any

import pydantic
import yaml
from pydantic import InstanceOf

from txl_dist.config.fields import ConfigError, UnknownKeyError, config_dataclass, make_validated
from txl_dist.config.files import COMMAND_LINE, key_paths, merge_mappings, read_layers
from txl_dist.config.model import N_TOKEN_FROM_MANIFEST, PRESETS, ModelConfig, same_length_problem
from txl_dist.config.sections import (
    BatchSplit,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    NumericsConfig,
    OptimConfig,
    PrecisionConfig,
    ProfileConfig,
    ScheduleConfig,
    TrainConfig,
    ZeroConfig,
)

__all__ = [
    "COMMAND_LINE",
    "PRESET_KEY",
    "SECTIONS",
    "BatchSplit",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LogConfig",
    "NumericsConfig",
    "OptimConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "RunConfig",
    "ScheduleConfig",
    "TrainConfig",
    "ZeroConfig",
    "load_config",
    "merge_mappings",
    "with_manifest_vocab",
]

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
    "numerics": NumericsConfig,
    "log": LogConfig,
    "profile": ProfileConfig,
}
"""The sections of a run config file, in the order they are printed."""

PRESET_KEY = "preset"


@config_dataclass
class RunConfig:
    """A whole training run. Each component receives its own section (``cfg.optim``), never this object. The
    sections were checked when they were made (InstanceOf: pydantic takes them as they are, the model with its
    placeholder n_token included); this checks the rules that join them."""

    model: InstanceOf[ModelConfig] = field(default_factory=ModelConfig)
    """Architecture; n_token is replaced by the manifest's vocabulary size at run time."""
    model_preset: str | None = None
    """The preset the model section started from (``model: {preset: NAME}``), kept for the record."""
    data: InstanceOf[DataConfig] = field(default_factory=DataConfig)
    """Shards and how they are read."""
    train: InstanceOf[TrainConfig] = field(default_factory=TrainConfig)
    """Output directory, length of the run, batch sizes."""
    optim: InstanceOf[OptimConfig] = field(default_factory=OptimConfig)
    """Optimizer and gradient clipping."""
    schedule: InstanceOf[ScheduleConfig] = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    precision: InstanceOf[PrecisionConfig] = field(default_factory=PrecisionConfig)
    """fp32, bf16 or fp16."""
    zero: InstanceOf[ZeroConfig] = field(default_factory=ZeroConfig)
    """ZeRO stage and offload."""
    eval: InstanceOf[EvalConfig] = field(default_factory=EvalConfig)
    """Periodic evaluation."""
    checkpoint: InstanceOf[CheckpointConfig] = field(default_factory=CheckpointConfig)
    """Checkpoint frequency, retention, resume."""
    numerics: InstanceOf[NumericsConfig] = field(default_factory=NumericsConfig)
    """The health check of every step, rollbacks and skipped data windows."""
    log: InstanceOf[LogConfig] = field(default_factory=LogConfig)
    """Logging frequency and TensorBoard."""
    profile: InstanceOf[ProfileConfig] = field(default_factory=ProfileConfig)
    """Profiled steps (torch.profiler)."""
    key_sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where each key path was last set ("in configs/x.yaml", "on the command line"), for error messages and
    for telling a value that was given from a default. Not part of the configuration itself."""

    @pydantic.model_validator(mode="after")
    def _check_across_sections(self) -> RunConfig:
        """The rules that join sections; ConfigError names the key and where it was set."""

        def require(ok: bool, key: str, value: Any, allowed: str) -> None:
            if not ok:
                raise ConfigError(key, value, allowed, self.key_sources.get(key))

        schedule = self.schedule
        total = schedule.resolved_total_steps(self.train.max_steps)
        total_name = "train.max_steps" if schedule.total_steps is None else "schedule.total_steps"
        require(
            schedule.warmup_steps <= total,
            "schedule.warmup_steps",
            schedule.warmup_steps,
            f"at most the schedule's length, {total_name}={total}",
        )
        if schedule.kind == "constant":
            require(
                schedule.min_lr == 0,
                "schedule.min_lr",
                schedule.min_lr,
                "0 with schedule.kind='constant' (a constant schedule never decays)",
            )
        require(
            schedule.min_lr <= self.optim.lr, "schedule.min_lr", schedule.min_lr, f"at most optim.lr={self.optim.lr}"
        )
        if self.zero.offload_optimizer != "none":
            require(
                self.zero.stage >= 1,
                "zero.offload_optimizer",
                self.zero.offload_optimizer,
                "'none' with zero.stage=0 (DeepSpeed offloads ZeRO-partitioned optimizer states: "
                "use zero.stage 1, 2 or 3)",
            )
        if self.profile.steps is not None:
            require(
                self.profile.steps[1] <= self.train.max_steps,
                "profile.steps",
                self.profile.steps,
                f"steps within the run: at most train.max_steps={self.train.max_steps}",
            )
        evaluation = self.eval.resolve(self.model)
        problem = same_length_problem(evaluation.same_length, evaluation.mem_len, "the evaluation mem_len")
        require(problem is None, "eval.same_length", evaluation.same_length, problem)
        return self

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
        return _config_from_data(data, {path: f"in {where}" for path in key_paths(data)})


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
    try:
        model = dataclasses.replace(cfg.model, n_token=vocab_size)
    except ValueError as error:
        raise ValueError(f"{error} (with n_token={vocab_size} from {manifest_where})") from None
    sources = {**cfg.key_sources, "model.n_token": f"in {manifest_where}"}
    return dataclasses.replace(cfg, model=model, key_sources=sources)


def load_config(
    paths: str | os.PathLike | Sequence[str | os.PathLike] | None, overrides: Sequence[str] = ()
) -> RunConfig:
    """Build the run config: defaults, then each file in ``paths`` (with its includes) left to right, then the
    ``key.path=value`` overrides. Raises ValueError naming the key, the value, what is allowed and its source."""
    return _config_from_data(*read_layers(paths, overrides, SECTIONS))


def _config_from_data(data: dict[str, Any], sources: dict[str, str]) -> RunConfig:
    """The validated config from merged plain data; ``sources`` (key path -> where it was set) go into errors."""
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
    context = {N_TOKEN_FROM_MANIFEST: "model.n_token" not in sources}
    model_data = dict(data.get("model", {}))
    preset_name = model_data.pop(PRESET_KEY, None)
    if preset_name is not None and (not isinstance(preset_name, str) or preset_name not in PRESETS):
        raise ConfigError("model.preset", preset_name, f"null or one of {sorted(PRESETS)}", sources.get("model.preset"))
    for name, cls in SECTIONS.items():
        values = model_data if name == "model" else data.get(name, {})
        if name == "model" and preset_name is not None:
            values = {**PRESETS[preset_name], **values}
        try:
            sections[name] = make_validated(cls, copy.deepcopy(values), context)
        except UnknownKeyError as error:  # a preset's keys are all fields: an unknown key was given
            error = error.allowing(PRESET_KEY) if name == "model" else error
            raise error.with_source(sources.get(error.key)) from None
        except ConfigError as error:
            raise error.with_source(sources.get(error.key)) from None
    return RunConfig(**sections, model_preset=preset_name, key_sources=sources)
