"""The facts of a training run resolved once, before any process group exists (`txl_dist.training.startup.resolve`):
the config, the shards' manifest, the batch split, the device, the launch, DeepSpeed's config. Every later step of
the start and the training loop reads them here, and none resolves them again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from txl_dist.config import BatchSplit, RunConfig
from txl_dist.data.format import Manifest
from txl_dist.rendezvous import launch_env
from txl_dist.training.init_from import InitSource, OpenSource
from txl_dist.training.numerics import NumericsRecord


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
    """What step 1 resolves, once, from the command line, the launcher's variables and the files."""

    cfg: RunConfig
    """The validated config, its vocabulary taken from the shards' manifest."""
    manifest: Manifest
    """data.shards' manifest."""
    batch_split: BatchSplit
    """The global batch over the launcher's world (`TrainConfig.batch_split`)."""
    tokenizer_fingerprint: str
    """The tokenizer's fingerprint: data.tokenizer's, checked whole against the manifest's, else the manifest's."""
    device_type: str
    """DeepSpeed's accelerator: "cuda", "cpu", ..."""
    launch: launch_env.LaunchEnvironment | None
    """The launcher's world as its variables say; None when they do not make one (`launch_error` says why)."""
    launch_error: launch_env.LaunchError | None
    deepspeed_overlay: str | None
    """--deepspeed_config: a JSON overlay of DeepSpeed's config."""
    deepspeed_config: dict[str, Any]
    """DeepSpeed's config for this world and device, the overlay merged (`build_deepspeed_config`): built once,
    here; the engine is built from a copy."""
    num_parameters: int
    """The model's parameters, counted from its shape (`txl_dist.plan.counts.ModelShape`: tied ones once)."""
    numerics_record: NumericsRecord
    """The run folder's numerics.json: the data windows skipped and the checkpoints kept after numerical faults."""
    init_source: InitSource | None = None
    """train.init_from, opened (`txl_dist.training.init_from`): the model the run starts from."""
    init_warning: str | None = None
    """What could not be checked of it (a model that records no tokenizer)."""
    open_source: OpenSource | None = None
    """The reader of models that the launcher gave (`txl_dist.convert.sources.open_source`)."""

    @property
    def world_size(self) -> int:
        return self.batch_split.world_size

    @property
    def launcher(self) -> str:
        """What started the ranks, as the run's reports name it (`LaunchEnvironment.name`)."""
        return self.launch.name if self.launch is not None else "unknown"
