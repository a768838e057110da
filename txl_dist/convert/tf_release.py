"""The authors' released TensorFlow models (their ``tf/sota/download.sh``) -> our weights, config and tokenizer.

    PRETRAINED_DIR/                      e.g. pretrained_xl/tf_wt103
      model/checkpoint                   TensorFlow's record of the latest checkpoint
      model/model.ckpt-0.index           the variables (lm1b: model.ckpt-1191000.*)
      model/model.ckpt-0.data-00000-of-00001
      data/cache.pkl                     their Corpus with its Vocab (read by txl_dist.convert.authors_vocab)
      data/corpus-info.json              {"vocab_size", "cutoffs", "dataset"}

The variables are read with TensorFlow's own checkpoint reader (an optional extra: ``pip install
'txl_dist[tf]'``); nothing else of TensorFlow runs. Their names are those of the authors' ``tf/model.py``:

    transformer/adaptive_embed/lookup_table, proj_W                  div_val 1: one table (and projection)
    transformer/adaptive_embed/cutoff_{i}/lookup_table, proj_W       div_val > 1: per cluster
    transformer/r_w_bias, r_r_bias                                   [n_head, d_head], or [n_layer, ...] (untie_r)
    transformer/layer_{l}/rel_attn/{qkv,r,o}/kernel                  [in, out], ours is [out, in]
    transformer/layer_{l}/rel_attn/LayerNorm/{gamma,beta}
    transformer/layer_{l}/ff/layer_{1,2}/{kernel,bias}, ff/LayerNorm/{gamma,beta}
    transformer/adaptive_softmax/bias                                no cutoffs: the full softmax's bias
    transformer/adaptive_softmax/cutoff_{i}/b, proj                  per cluster (proj absent: tied, or none)
    transformer/adaptive_softmax/cutoff_0/cluster_W, cluster_b      the tail clusters' rows of the head

The architecture is read from the shapes: n_layer, d_model, n_head, d_head, d_inner, d_embed, div_val, the
cutoffs (checked against corpus-info.json), untie_r, which projections are tied, and where their
``proj_same_dim=False`` left a cluster of width d_model without one (the identity here). Their output layer always
shares the embedding tables (tie_weight), and their layer norm's epsilon is TensorFlow's 1e-12. What the
checkpoint cannot say, the evaluation settings and the dropout of their training, is taken from their scripts
(`txl_dist.convert.tf_release_folder.RELEASE_SETTINGS`: ``tf/sota/<dataset>.sh`` and
``tf/scripts/<dataset>_large_tpu.sh``) and may be given. Where the folder's files are: `tf_release_folder`.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txl_dist.config.model import ModelConfig
from txl_dist.convert.authors_vocab import DATASETS, AuthorsVocabulary, read_cache, write_authors_tokenizer
from txl_dist.convert.tf_release_folder import (
    RELEASE_SETTINGS,
    Release,
    ReleaseError,
    locate,
    read_corpus_info,
)
from txl_dist.export import write_export
from txl_dist.fileio import sha256_files

TF_LAYER_NORM_EPS = 1e-12
"""``tf.contrib.layers.layer_norm``'s epsilon, which every layer norm of their TensorFlow model uses."""

SCOPE = "transformer/"
_IGNORED = re.compile(r"(^|/)(Adam|Adam_1|Momentum|ExponentialMovingAverage)$|^global_step$|^beta[12]_power")


def tensorflow():
    """TensorFlow, imported quietly; a `ReleaseError` saying how to install it when it is missing."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf  # optional dependency (the tf extra)
    except ImportError as error:
        raise ReleaseError(
            f"reading the authors' TensorFlow checkpoints needs TensorFlow ({error}): pip install "
            f"'txl_dist[tf]' (tensorflow-cpu), or pip install tensorflow"
        ) from None
    return tf


def read_variables(prefix: Path) -> _Variables:
    """The model's variables of a TensorFlow checkpoint (optimizer slots and counters left out): their shapes
    now, each value when it is taken."""
    tf = tensorflow()
    try:
        reader = tf.train.load_checkpoint(str(prefix))
        shapes = {
            name: tuple(shape)
            for name, shape in reader.get_variable_to_shape_map().items()
            if not _IGNORED.search(name)
        }
    except (tf.errors.OpError, ValueError, OSError) as error:
        raise ReleaseError(f"{prefix}: not a readable TensorFlow checkpoint ({_first_line(error)})") from None

    def fetch(name: str) -> np.ndarray:
        try:
            return np.asarray(reader.get_tensor(name))
        except (tf.errors.OpError, ValueError, OSError) as error:
            raise ReleaseError(f"{prefix}: variable {name!r} cannot be read ({_first_line(error)})") from None

    return _Variables(shapes, fetch, str(prefix))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _Variables:
    """A checkpoint's variables: each shape known, each value read when taken (once); `require` names a missing
    or misshapen one."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], fetch: Callable[[str], np.ndarray], where: str):
        self.shapes, self.fetch, self.where, self.taken = dict(shapes), fetch, where, set()

    def has(self, name: str) -> bool:
        return SCOPE + name in self.shapes

    def shape(self, name: str) -> tuple[int, ...]:
        self._require_present(name)
        return self.shapes[SCOPE + name]

    def _require_present(self, name: str) -> None:
        if SCOPE + name not in self.shapes:
            raise ReleaseError(
                f"{self.where}: no variable {SCOPE + name!r}, which the authors' model has for this architecture"
            )

    def require(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        self._require_present(name)
        full = SCOPE + name
        if shape is not None and self.shapes[full] != tuple(shape):
            raise ReleaseError(
                f"{self.where}: variable {full!r} has shape {list(self.shapes[full])}, expected {list(shape)}"
            )
        self.taken.add(full)
        return self.fetch(full)

    def untaken(self) -> list[str]:
        return sorted(set(self.shapes) - self.taken)


def architecture(variables: _Variables, info: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The model fields the checkpoint's shapes say (and corpus-info.json's vocabulary and cutoffs)."""
    layers = sorted(
        {int(m.group(1)) for name in variables.shapes if (m := re.match(r"transformer/layer_(\d+)/", name))}
    )
    if not layers or layers != list(range(len(layers))):
        raise ReleaseError(f"{where}: its layers are {layers or 'none'}; expected transformer/layer_0 .. layer_N")
    n_layer = len(layers)
    bias_shape = variables.shape("r_w_bias")
    untie_r = len(bias_shape) == 3
    n_head, d_head = bias_shape[-2:]
    d_model = variables.shape("layer_0/rel_attn/qkv/kernel")[0]
    d_inner = variables.shape("layer_0/ff/layer_1/kernel")[1]
    n_token = info["vocab_size"]
    cutoffs = list(info["cutoffs"][1:-1])
    if variables.has("adaptive_embed/lookup_table"):
        div_val, d_embed = 1, variables.shape("adaptive_embed/lookup_table")[1]
        rows = [variables.shape("adaptive_embed/lookup_table")[0]]
        total = rows[0]
    else:
        widths, rows, index = [], [], 0
        while variables.has(f"adaptive_embed/cutoff_{index}/lookup_table"):
            table_rows, width = variables.shape(f"adaptive_embed/cutoff_{index}/lookup_table")
            rows.append(table_rows)
            widths.append(width)
            index += 1
        if len(widths) < 2:
            raise ReleaseError(
                f"{where}: no variable 'transformer/adaptive_embed/lookup_table' nor two or more "
                f"'transformer/adaptive_embed/cutoff_<i>/lookup_table': not the authors' embedding"
            )
        d_embed, div_val = widths[0], widths[0] // widths[1]
        if div_val < 2 or [d_embed // div_val**i for i in range(len(widths))] != widths:
            raise ReleaseError(f"{where}: the embedding clusters' widths {widths} follow no div_val")
        found = list(np.cumsum(rows)[:-1])
        if found != cutoffs:
            raise ReleaseError(
                f"{where}: the embedding clusters cut the vocabulary at {found}, but corpus-info.json says {cutoffs}"
            )
        total = sum(rows)
    if total != n_token:
        raise ReleaseError(f"{where}: the embedding has {total} rows, but corpus-info.json says vocab_size {n_token}")
    tie_projs = _tied_projections(variables, len(cutoffs))
    return dict(
        n_token=n_token,
        n_layer=n_layer,
        n_head=n_head,
        d_head=d_head,
        d_model=d_model,
        d_inner=d_inner,
        d_embed=d_embed,
        div_val=div_val,
        cutoffs=cutoffs,
        tie_weight=True,
        tie_projs=tie_projs,
        untie_r=untie_r,
        pre_lnorm=False,
        layer_norm_eps=TF_LAYER_NORM_EPS,
    )


def _tied_projections(variables: _Variables, n_tails: int) -> list[bool]:
    """Per cluster: whether the softmax uses the embedding's projection (their ``tie_projs``). A cluster without
    a ``proj`` of its own is tied; with no projection on either side (a cluster of width d_model under
    ``proj_same_dim=False``) both are the identity, tied or not."""
    if n_tails == 0:
        return [True]  # their full softmax always uses the embedding's projection
    return [not variables.has(f"adaptive_softmax/cutoff_{i}/proj") for i in range(n_tails + 1)]


def state_dict(variables: _Variables, config: ModelConfig, keep: bool = True) -> dict[str, torch.Tensor]:
    """Our state dict (`TransformerXLLM(config)`, tied keys left out) from the checkpoint's variables. Without
    ``keep``, every variable is only checked for presence and shape (`check_variables`)."""
    state: dict[str, torch.Tensor] = {}
    d_model = config.d_model
    widths = [config.d_embed_resolved // config.div_val**i for i in range(len(config.cutoffs) + 1)]

    def put(key: str, value: np.ndarray, transpose: bool = False) -> None:
        if keep:
            array = np.ascontiguousarray(value.T if transpose else value, dtype=np.float32)
            state[key] = torch.from_numpy(array.copy())

    def projection(name: str, width: int) -> np.ndarray:
        """[width, d_model] as TensorFlow stores it; the identity where their model has none."""
        if variables.has(name):
            return variables.require(name, (width, d_model))
        return np.eye(width, d_model, dtype=np.float32)

    if config.div_val == 1:
        put("word_emb.emb_layers.0.weight", variables.require("adaptive_embed/lookup_table"))
        if config.d_embed_resolved != d_model:
            put("word_emb.emb_projs.0", variables.require("adaptive_embed/proj_W", (widths[0], d_model)), True)
    else:
        for i, width in enumerate(widths):
            put(f"word_emb.emb_layers.{i}.weight", variables.require(f"adaptive_embed/cutoff_{i}/lookup_table"))
            put(f"word_emb.emb_projs.{i}", projection(f"adaptive_embed/cutoff_{i}/proj_W", width), True)

    shape = (config.n_layer, config.n_head, config.d_head) if config.untie_r else (config.n_head, config.d_head)
    biases = {which: variables.require(f"r_{which}_bias", shape) for which in ("w", "r")}
    for layer in range(config.n_layer):
        ours, theirs = f"layers.{layer}.", f"layer_{layer}/"
        hd = config.n_head * config.d_head
        put(
            ours + "dec_attn.qkv_net.weight", variables.require(theirs + "rel_attn/qkv/kernel", (d_model, 3 * hd)), True
        )
        put(ours + "dec_attn.r_net.weight", variables.require(theirs + "rel_attn/r/kernel", (d_model, hd)), True)
        put(ours + "dec_attn.o_net.weight", variables.require(theirs + "rel_attn/o/kernel", (hd, d_model)), True)
        for norm, scope in (("dec_attn.layer_norm", "rel_attn/LayerNorm"), ("pos_ff.layer_norm", "ff/LayerNorm")):
            put(ours + norm + ".weight", variables.require(theirs + scope + "/gamma", (d_model,)))
            put(ours + norm + ".bias", variables.require(theirs + scope + "/beta", (d_model,)))
        d_inner = config.d_inner
        put(ours + "pos_ff.CoreNet.0.weight", variables.require(theirs + "ff/layer_1/kernel", (d_model, d_inner)), True)
        put(ours + "pos_ff.CoreNet.0.bias", variables.require(theirs + "ff/layer_1/bias", (d_inner,)))
        put(ours + "pos_ff.CoreNet.3.weight", variables.require(theirs + "ff/layer_2/kernel", (d_inner, d_model)), True)
        put(ours + "pos_ff.CoreNet.3.bias", variables.require(theirs + "ff/layer_2/bias", (d_model,)))
        if config.untie_r:
            for which, value in biases.items():
                put(ours + f"dec_attn.r_{which}_bias", value[layer])
    if not config.untie_r:
        for which, value in biases.items():
            put(f"r_{which}_bias", value)

    _softmax(variables, config, widths, put, projection)
    return state


def _softmax(
    variables: _Variables, config: ModelConfig, widths: list[int], put: Callable, projection: Callable
) -> None:
    """The adaptive softmax's own variables: biases, the head's cluster rows, untied projections."""
    n_token, cutoffs, d_model = config.n_token, config.cutoffs, config.d_model
    tied = config.tie_projs_resolved
    if not cutoffs:
        put("crit.out_layers.0.bias", variables.require("adaptive_softmax/bias", (n_token,)))
        return
    ends = [0, *cutoffs, n_token]
    biases = [
        variables.require(f"adaptive_softmax/cutoff_{i}/b", (ends[i + 1] - ends[i],)) for i in range(len(ends) - 1)
    ]
    put("crit.cluster_weight", variables.require("adaptive_softmax/cutoff_0/cluster_W", (len(cutoffs), widths[0])))
    put("crit.cluster_bias", variables.require("adaptive_softmax/cutoff_0/cluster_b", (len(cutoffs),)))
    if config.div_val == 1:
        put("crit.out_layers.0.bias", np.concatenate(biases))
        if config.d_embed_resolved != d_model:
            for i in range(len(biases)):
                if not tied[i]:
                    put(
                        f"crit.out_projs.{i}",
                        variables.require(f"adaptive_softmax/cutoff_{i}/proj", (widths[0], d_model)),
                        True,
                    )
        return
    for i, (bias, width) in enumerate(zip(biases, widths)):
        put(f"crit.out_layers.{i}.bias", bias)
        if not tied[i]:
            put(f"crit.out_projs.{i}", projection(f"adaptive_softmax/cutoff_{i}/proj", width), True)


@dataclass
class OpenedRelease:
    """A release read up to its weights: the config from the checkpoint's shapes, the variables still unread."""

    config: ModelConfig
    dataset: str
    release: Release
    variables: _Variables
    given: dict[str, Any]

    def weights(self) -> dict[str, torch.Tensor]:
        """Our state dict, every variable of the checkpoint's model read and used."""
        return state_dict(self.variables, self.config)

    def source(self) -> dict[str, Any]:
        """What an export's training.json records of it: the files and their sha256."""
        release = self.release
        files = sorted(release.prefix.parent.glob(release.prefix.name + ".*")) + [release.cache, release.corpus_info]
        given = f", given {sorted(self.given)}" if self.given else ""
        return {
            "converted_from": "tensorflow",
            "source": str(release.root.resolve()),
            "checkpoint": str(release.prefix.resolve()),
            "dataset": self.dataset,
            "settings_from": "the authors' tf/sota and tf/scripts settings" + given,
            "sha256": sha256_files(files),
        }


def open_release(
    root: str | os.PathLike, checkpoint: str | None = None, settings: Mapping[str, Any] | None = None
) -> OpenedRelease:
    """The config of a release folder's model: the architecture from the checkpoint's shapes, `RELEASE_SETTINGS`
    completed by ``settings``; its weights are read by `OpenedRelease.weights`."""
    release = locate(root, checkpoint)
    info = read_corpus_info(release.corpus_info)
    dataset = info.get("dataset")
    if dataset not in DATASETS:
        raise ReleaseError(
            f"{release.corpus_info}: key 'dataset' is {dataset!r}; the authors' code knows {list(DATASETS)}"
        )
    given = {name: value for name, value in (settings or {}).items() if value is not None}
    chosen = {**RELEASE_SETTINGS.get(dataset, {}), **given}
    missing = [name for name in ("tgt_len", "mem_len", "clamp_len", "same_length") if name not in chosen]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise ReleaseError(
            f"the authors released no {dataset} model, so its evaluation settings are unknown: give {flags}"
        )
    variables = read_variables(release.prefix)
    fields = architecture(variables, info, variables.where)
    fields.update({"dropout": 0.0, "dropatt": 0.0, **chosen})
    config = ModelConfig.from_dict(fields, where=variables.where)
    check_variables(variables, config)
    return OpenedRelease(config, dataset, release, variables, given)


def check_variables(variables: _Variables, config: ModelConfig) -> None:
    """Every variable the model of ``config`` has is present with its shape, and no other (from the shapes
    alone: nothing read); `ReleaseError` naming the first that is not."""
    dry = _Variables(
        variables.shapes, lambda name: np.broadcast_to(np.float32(0), variables.shapes[name]), variables.where
    )
    state_dict(dry, config, keep=False)
    left = [name for name in dry.untaken() if name.startswith(SCOPE)]
    if left:
        raise ReleaseError(
            f"{variables.where}: variable {left[0]!r} ({len(left)} in all) has no place in the authors' model as read"
        )


def vocabulary_of(release: Release):
    """The authors' vocabulary of a release (`txl_dist.convert.authors_vocab.read_cache`)."""
    return read_cache(release.cache)


def write_release_export(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    checkpoint: str | None = None,
    settings: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> tuple[Path, OpenedRelease]:
    """A release folder -> an export folder with the authors' vocabulary as its tokenizer."""
    # The vocabulary first: a refused cache.pkl stops the conversion before TensorFlow is even imported.
    vocabulary = vocabulary_of(locate(root, checkpoint))
    opened = open_release(root, checkpoint, settings)
    with authors_tokenizer(opened, vocabulary) as folder:
        out = write_export(
            opened.weights(),
            opened.config,
            out_dir,
            tokenizer_dir=folder,
            training_info=opened.source(),
            overwrite=overwrite,
        )
    return out, opened


@contextlib.contextmanager
def authors_tokenizer(opened: OpenedRelease, vocabulary: AuthorsVocabulary | None = None) -> Iterator[Path]:
    """The release's vocabulary written as a txl_dist tokenizer in a temporary folder (removed on leaving)."""
    vocabulary = vocabulary or vocabulary_of(opened.release)
    if len(vocabulary.symbols) != opened.config.n_token:
        raise ReleaseError(
            f"{opened.release.cache}: {len(vocabulary.symbols)} symbols, but the model has n_token "
            f"{opened.config.n_token} ({opened.release.corpus_info})"
        )
    with tempfile.TemporaryDirectory(prefix="txl_dist-authors-vocab-") as folder:
        write_authors_tokenizer(vocabulary, opened.dataset, folder, opened.release.cache)
        yield Path(folder)
