"""``train.init_from``: a run that starts from a trained model's weights, with a fresh optimizer, schedule, step
count and data position (fine-tuning; torchtitan's ``initial_load_path``, fairseq's ``--finetune-from-model``).

The model is any that txl_dist reads (`txl_dist.convert.sources.open_source` says which and reads it; the
launcher hands that reader to `txl_dist.training.startup`, which lies below the conversions). What this module
decides:

- The architecture is the model's (`model_from_source`): every field that fixes a weight's shape or what the
  weights compute (`FROM_THE_MODEL`: n_token, n_layer, ..., layer_norm_eps) is taken from it, and one the
  config gives with another value is refused in one line naming the key and both values. The settings that
  change no weight (dropout, dropatt, tgt_len, mem_len, clamp_len, same_length) are the config's where it gives
  them, else the model's.
- The run's shards must be built with the model's tokenizer (`require_source_tokenizer`): fingerprints compared.
- The weights are read once, by rank 0, and broadcast (`broadcast_source_weights`), only when the run starts
  fresh: a rerun resumes from the run's own checkpoints and never reads the model again.
- The run records where it started from (`InitRecord`, ``init_from.json`` in the run folder: the path, the kind,
  a sha256 of the weights' files, the model's config and tokenizer identity), which every start of the run logs
  (metrics.jsonl's start record, TensorBoard's run/environment text). A rerun takes the architecture from that
  record, so it resumes even where the model has since moved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from txl_dist.checkpoints.universal import ResumePlan
from txl_dist.config import RunConfig
from txl_dist.config.model import MODEL_FIELD_ROLES, PRESETS, ModelConfig
from txl_dist.data.format import Manifest
from txl_dist.export import config_from_json, config_to_json, require_finite, unique_weights
from txl_dist.export.weights import tensor_shapes
from txl_dist.fileio import atomic_write_text
from txl_dist.rendezvous import ranks

RECORD_FILE = "init_from.json"
FROM_THE_MODEL = (*MODEL_FIELD_ROLES.architecture, "layer_norm_eps")
"""Fields taken from the model whatever the config says (a different given value is refused)."""
MODEL_SETTINGS = ("dropout", "dropatt", "tgt_len", "mem_len", "clamp_len", "same_length", "init_std", "proj_init_std")
"""Fields taken from the model unless the config gives them."""


@dataclasses.dataclass
class InitSource:
    """A trained model to start from, opened: its config and tokenizer identity read, its weights on demand."""

    path: str
    kind: str
    """What it is, in words: "an export folder", "a training checkpoint", ..."""
    config: ModelConfig
    tokenizer: dict[str, Any] | None
    """The identity of the tokenizer it was trained with (None where the model does not record one)."""
    sha256: str
    """Of the files that hold its weights (for a training checkpoint: of its COMPLETE.json, which lists every
    file's checksum)."""
    details: dict[str, Any]
    """What else identifies it (a checkpoint's tag and step, a release's dataset, ...)."""
    read_weights: Callable[[], dict[str, torch.Tensor]] | None
    """Our state dict (tied keys may be left out); None for a source known only from a run's record."""
    tokenizer_directory: Callable[[], contextlib.AbstractContextManager[Path | None]] | None = None
    """A context giving the folder of its tokenizer (made for the while where the model has none as such: the
    authors' vocabulary), or None where it keeps none (a folder of export-to-hub holds transformers' files)."""


OpenSource = Callable[[str], InitSource]
"""Opens the model at a path (`txl_dist.convert.sources.open_source`); ValueError naming what it cannot read."""


def resolve_init_from(
    cfg: RunConfig, manifest: Manifest | None, open_source: OpenSource | None
) -> tuple[RunConfig, InitSource, str | None]:
    """Step 1 of a run with train.init_from: (the config with the model's architecture, the model opened, a
    warning to log or None). A rerun takes the model from the run's record (`InitRecord`) without opening it."""
    path = cfg.train.init_from
    record = InitRecord.read(cfg.train.output_dir) if cfg.train.output_dir is not None else None
    source = record.source(path) if record is not None else None
    if source is None:
        if open_source is None:
            raise ValueError(
                f"train.init_from={path}: this start reads no models; start the run with launchers/train.py"
            )
        try:
            source = open_source(path)
        except OSError as error:
            raise ValueError(f"train.init_from={path}: {error.filename or path}: {error.strerror or error}") from None
    cfg = model_from_source(cfg, source)
    warning = require_source_tokenizer(source, manifest, cfg.data.shards) if manifest is not None else None
    return cfg, source, warning


def model_from_source(cfg: RunConfig, source: InitSource) -> RunConfig:
    """``cfg`` with the model section taken from ``source`` (see the module docstring); ValueError for a
    given field that would change the weights' shapes or meaning."""
    given = _given_model_fields(cfg)
    fields = {}
    for name in FROM_THE_MODEL:
        theirs, ours = getattr(source.config, name), getattr(cfg.model, name)
        if name == "d_embed":
            theirs, ours = source.config.d_embed_resolved, cfg.model.d_embed_resolved
        elif name == "tie_projs":
            theirs, ours = source.config.tie_projs_resolved, cfg.model.tie_projs_resolved
        if name in given and ours != theirs:
            what = "what the weights compute" if name == "layer_norm_eps" else "the shape of the weights"
            key = "model.preset" if given[name].startswith("by model.preset") else f"model.{name}"
            raise ValueError(
                f"model.{name}={ours!r} (set {given[name]}) would change {what} of train.init_from={source.path}, "
                f"whose {name} is {theirs!r}: leave {key} out of the config (the architecture is the model's)"
            )
        fields[name] = theirs
    for name in MODEL_SETTINGS:
        if name not in given:
            fields[name] = getattr(source.config, name)
    try:
        model = dataclasses.replace(cfg.model, **fields)
    except ValueError as error:
        raise ValueError(f"train.init_from={source.path}: {error}") from None
    where = f"from train.init_from={source.path}"
    sources = {**cfg.key_sources, **{f"model.{name}": where for name in fields}}
    return dataclasses.replace(cfg, model=model, model_preset=None, key_sources=sources)


def _given_model_fields(cfg: RunConfig) -> dict[str, str]:
    """The model fields the config files or the command line set (a preset sets all of its own), and where."""
    given = {}
    preset_source = cfg.key_sources.get("model.preset")
    if preset_source is not None and cfg.model_preset is not None:
        given.update(
            {name: f"by model.preset={cfg.model_preset} {preset_source}" for name in PRESETS[cfg.model_preset]}
        )
    for path, where in cfg.key_sources.items():
        if path.startswith("model.") and path != "model.preset":
            given[path.removeprefix("model.")] = where
    given.pop("n_token", None)  # the manifest's (with_shards_vocab), checked against the tokenizer below
    return given


def require_source_tokenizer(source: InitSource, manifest: Manifest, shards: str) -> str | None:
    """ValueError when the shards were built with another tokenizer than the model's; a warning line to log when
    the model records none (only the vocabulary size can then be compared)."""
    built = manifest.tokenizer
    if source.tokenizer is None:
        if built.vocab_size != source.config.n_token:
            raise ValueError(
                f"train.init_from={source.path} has n_token {source.config.n_token}, but the shards {shards} have a "
                f"vocabulary of {built.vocab_size}: build them with the model's tokenizer"
            )
        return (
            f"train.init_from={source.path} records no tokenizer: only its vocabulary size ({built.vocab_size}) "
            f"could be checked against the shards {shards}; make sure they were built with its tokenizer"
        )
    if source.tokenizer.get("fingerprint") != built.fingerprint:
        raise ValueError(
            f"the shards {shards} were built with the tokenizer of fingerprint {built.fingerprint[:16]}..., but "
            f"train.init_from={source.path} was trained with {str(source.tokenizer.get('fingerprint'))[:16]}...: "
            f"build the shards with the model's tokenizer (data_tools.build_shards --tokenizer {source.path})"
        )
    return None


@dataclasses.dataclass
class InitRecord:
    """``init_from.json``: where a run started from, written at its first start."""

    record: dict[str, Any]

    @staticmethod
    def path(output_dir: str | os.PathLike) -> Path:
        return Path(output_dir) / RECORD_FILE

    @classmethod
    def of(cls, source: InitSource) -> InitRecord:
        return cls(
            {
                "path": str(Path(source.path).resolve()),
                "kind": source.kind,
                "sha256": source.sha256,
                **source.details,
                "model": config_to_json(source.config, source.tokenizer),
            }
        )

    @classmethod
    def read(cls, output_dir: str | os.PathLike) -> InitRecord | None:
        """The record of the run folder, None where there is none; ValueError naming a damaged one."""
        path = cls.path(output_dir)
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"{path}: not readable JSON ({error}); remove it to start from train.init_from again"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("model"), dict) or "path" not in record:
            raise ValueError(f"{path}: not a record of train.init_from (keys 'path' and 'model')")
        return cls(record)

    def source(self, path: str) -> InitSource | None:
        """The model this record names, as an `InitSource` without weights, when it is the one at ``path``."""
        if self.record["path"] != str(Path(path).resolve()):
            return None
        config, tokenizer = config_from_json(self.record["model"], str(self.path("")))
        details = {k: v for k, v in self.record.items() if k not in ("path", "kind", "sha256", "model")}
        return InitSource(path, self.record["kind"], config, tokenizer, self.record["sha256"], details, None)

    def write(self, output_dir: str | os.PathLike) -> None:
        atomic_write_text(self.path(output_dir), json.dumps(self.record, indent=1) + "\n")

    def summary(self) -> dict[str, Any]:
        """What the logs name: everything but the model's config."""
        return {key: value for key, value in self.record.items() if key != "model"}


def broadcast_source_weights(
    source: InitSource, open_source: OpenSource | None, place: ranks.Place
) -> dict[str, torch.Tensor]:
    """Collective: the model's weights on every rank, read by rank 0 alone (every rank reading would multiply
    the reads and the host memory by the ranks of a node)."""
    weights = None
    if place.rank == 0:
        read = source.read_weights
        if read is None:  # known from the run's record: open it again
            if open_source is None:
                raise ValueError(f"train.init_from={source.path}: no reader of models was given to this start")
            read = open_source(source.path).read_weights
        weights = read()
    return ranks.broadcast_tensors(weights, place.device)


def load_source_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], where: str) -> None:
    """Put ``weights`` (tied keys may be missing) into ``model``; a missing, extra, misshapen or non-finite weight
    is an error naming it."""
    unique = unique_weights(weights, model.config, where)
    require_finite(unique, where)
    _, aliases = tensor_shapes(model.config)
    with torch.no_grad():
        model.load_state_dict({**unique, **{alias: unique[name] for alias, name in aliases.items()}}, strict=True)


def start_from(
    source: InitSource | None,
    open_source: OpenSource | None,
    warning: str | None,
    output_dir: str,
    place: ranks.Place,
    resume_plan: ResumePlan | None,
) -> tuple[InitRecord | None, dict[str, torch.Tensor] | None]:
    """Collective, for train.init_from (`txl_dist.training.startup`'s step 5, second half): a fresh start takes
    the model's weights (read by rank 0 through ``open_source``, broadcast) and records where they came from in
    ``output_dir``; a resume takes none (its checkpoint has the run's own) and names the record. ``warning``: what
    could not be checked of the source, said once."""
    if source is None:
        return None, None
    log = logging.getLogger("txl_dist.training")
    if warning is not None and place.rank == 0:
        log.warning("%s", warning)
    if resume_plan is not None:
        record = InitRecord.read(output_dir)
        if place.rank == 0:
            log.info("train.init_from=%s: not read, the run resumes from its own %s", source.path, resume_plan.tag)
        return record, None
    weights = broadcast_source_weights(source, open_source, place)
    record = InitRecord.of(source)
    if place.rank == 0:
        record.write(output_dir)
        log.info("starting from %s %s (sha256 %s)", source.kind, source.path, source.sha256)
    return record, weights
