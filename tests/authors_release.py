"""Folders laid out as the authors' released models (their ``tf/sota/download.sh``), made here: a TensorFlow
checkpoint with the variable names and shapes of their ``tf/model.py``, a ``cache.pkl`` pickled from classes of
their names (``data_utils.Corpus``, ``vocabulary.Vocab``) and a ``corpus-info.json``; and the oracle the tests
compare a conversion with: transformers 4.37.2's TransfoXL holding the checkpoint's variables as its own TF
loader places them.

The checkpoint is written with TensorFlow's ``SaveV2`` op (only these helpers need TensorFlow; `write_cache`
does not).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pickle
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

SCOPE = "transformer/"


@contextlib.contextmanager
def _authors_modules(*names: tuple[str, str]) -> Iterator[dict[str, type]]:
    """Classes named as the authors' (module ``data_utils``, class ``Corpus``, ...), importable while pickling."""
    classes, added = {}, []
    for module_name, class_name in names:
        module = sys.modules.get(module_name) or types.ModuleType(module_name)
        cls = type(class_name, (), {"__module__": module_name, "__qualname__": class_name})
        setattr(module, class_name, cls)
        if module_name not in sys.modules:
            sys.modules[module_name] = module
            added.append(module_name)
        classes[class_name] = cls
    try:
        yield classes
    finally:
        for module_name in added:
            del sys.modules[module_name]


def write_cache(
    path: Path,
    dataset: str,
    symbols: list[str],
    *,
    special: list[str] = (),
    lower_case: bool = False,
    unk_idx: int | None = None,
    extra: Any = None,
    protocol: int = 2,
) -> Path:
    """A ``cache.pkl`` as their ``get_lm_corpus`` pickles it: a Corpus (dataset, vocab, token arrays, cutoffs)
    whose Vocab has ``symbols`` as ``idx2sym``; ``extra``, when given, is pickled as one more attribute (a payload
    for the refusal tests)."""
    with _authors_modules(("data_utils", "Corpus"), ("vocabulary", "Vocab")) as classes:
        vocab = classes["Vocab"]()
        vocab.counter = collections.Counter({symbol: len(symbols) - i for i, symbol in enumerate(symbols)})
        vocab.special, vocab.min_freq, vocab.max_size = list(special), 0, None
        vocab.lower_case, vocab.delimiter, vocab.vocab_file = lower_case, None, None
        vocab.idx2sym = list(symbols)
        vocab.sym2idx = collections.OrderedDict((symbol, i) for i, symbol in enumerate(symbols))
        if unk_idx is not None:
            vocab.unk_idx = unk_idx
        corpus = classes["Corpus"]()
        corpus.dataset, corpus.vocab, corpus.cutoffs = dataset, vocab, []
        corpus.train = np.arange(1000, dtype=np.int64) % len(symbols)
        corpus.valid = corpus.test = np.arange(100, dtype=np.int64) % len(symbols)
        if extra is not None:
            corpus.extra = extra
        path.write_bytes(pickle.dumps(corpus, protocol=protocol))
    return path


def variables(
    *,
    n_token: int,
    cutoffs: list[int],
    n_layer: int,
    d_model: int,
    n_head: int,
    d_head: int,
    d_inner: int,
    d_embed: int,
    div_val: int,
    tie_projs: list[bool],
    untie_r: bool,
    proj_same_dim: bool = True,
    seed: int = 0,
    scale: float = 0.3,
) -> dict[str, np.ndarray]:
    """The variables their ``tf/model.py`` creates for these settings (``mask_adaptive_embedding_lookup``,
    ``rel_multihead_attn``, ``positionwise_FF``, ``mask_adaptive_logsoftmax``), random, plus ``global_step`` and
    Adam slots as a training checkpoint holds them."""
    rng = np.random.default_rng(seed)

    def draw(*shape: int) -> np.ndarray:
        return rng.normal(0.0, scale, size=shape).astype(np.float32)

    found: dict[str, np.ndarray] = {}
    bias_shape = (n_layer, n_head, d_head) if untie_r else (n_head, d_head)
    found[SCOPE + "r_w_bias"], found[SCOPE + "r_r_bias"] = draw(*bias_shape), draw(*bias_shape)
    ends = [0, *cutoffs, n_token]
    widths = [d_embed // div_val**i for i in range(len(ends) - 1)] if div_val > 1 else [d_embed] * (len(ends) - 1)
    if div_val == 1:
        found[SCOPE + "adaptive_embed/lookup_table"] = draw(n_token, d_embed)
        if d_embed != d_model:
            found[SCOPE + "adaptive_embed/proj_W"] = draw(d_embed, d_model)
    else:
        for i, width in enumerate(widths):
            found[SCOPE + f"adaptive_embed/cutoff_{i}/lookup_table"] = draw(ends[i + 1] - ends[i], width)
            if proj_same_dim or width != d_model:
                found[SCOPE + f"adaptive_embed/cutoff_{i}/proj_W"] = draw(width, d_model)
    for layer in range(n_layer):
        prefix = SCOPE + f"layer_{layer}/"
        found[prefix + "rel_attn/qkv/kernel"] = draw(d_model, 3 * n_head * d_head)
        found[prefix + "rel_attn/r/kernel"] = draw(d_model, n_head * d_head)
        found[prefix + "rel_attn/o/kernel"] = draw(n_head * d_head, d_model)
        found[prefix + "ff/layer_1/kernel"], found[prefix + "ff/layer_1/bias"] = draw(d_model, d_inner), draw(d_inner)
        found[prefix + "ff/layer_2/kernel"], found[prefix + "ff/layer_2/bias"] = draw(d_inner, d_model), draw(d_model)
        for norm in ("rel_attn/LayerNorm", "ff/LayerNorm"):
            found[prefix + norm + "/gamma"] = 1 + draw(d_model)
            found[prefix + norm + "/beta"] = draw(d_model)
    if not cutoffs:
        found[SCOPE + "adaptive_softmax/bias"] = draw(n_token)
    else:
        for i, width in enumerate(widths):
            found[SCOPE + f"adaptive_softmax/cutoff_{i}/b"] = draw(ends[i + 1] - ends[i])
            no_projection = (div_val == 1 or not proj_same_dim) and width == d_model
            if not tie_projs[i] and not no_projection:
                found[SCOPE + f"adaptive_softmax/cutoff_{i}/proj"] = draw(width, d_model)
        found[SCOPE + "adaptive_softmax/cutoff_0/cluster_W"] = draw(len(cutoffs), d_embed)
        found[SCOPE + "adaptive_softmax/cutoff_0/cluster_b"] = draw(len(cutoffs))
    slots = {f"{name}/Adam": np.zeros_like(value) for name, value in list(found.items())[:3]}
    return {**found, **slots, "global_step": np.asarray(1000, dtype=np.int64)}


def save_checkpoint(prefix: Path, values: dict[str, np.ndarray]) -> None:
    """A TensorFlow (V2) checkpoint of ``values`` under their names: PREFIX.index and PREFIX.data-00000-of-00001."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    names = sorted(values)
    tf.raw_ops.SaveV2(
        prefix=str(prefix),
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[tf.constant(values[name]) for name in names],
    )


def write_release(
    root: Path,
    dataset: str,
    symbols: list[str],
    settings: dict[str, Any],
    *,
    special: list[str] = (),
    lower_case: bool = False,
    unk_idx: int | None = None,
    step: int = 0,
    drop: tuple[str, ...] = (),
) -> Path:
    """A release folder (model/, data/) of a model with ``settings`` (the keywords of `variables`) whose
    vocabulary is ``symbols``; ``drop`` leaves variables out. Returns the checkpoint prefix."""
    (root / "model").mkdir(parents=True)
    (root / "data").mkdir()
    values = variables(**settings)
    for name in drop:
        del values[name]
    prefix = root / "model" / f"model.ckpt-{step}"
    save_checkpoint(prefix, values)
    # TensorFlow's record of the latest checkpoint, with the absolute paths of the machine that trained it.
    (root / "model" / "checkpoint").write_text(
        f'model_checkpoint_path: "/home/them/EXP-{dataset}/model.ckpt-{step}"\n'
        f'all_model_checkpoint_paths: "/home/them/EXP-{dataset}/model.ckpt-{step}"\n'
    )
    n_token, cutoffs = settings["n_token"], settings["cutoffs"]
    info = {"vocab_size": n_token, "cutoffs": [0, *cutoffs, n_token] if cutoffs else [], "dataset": dataset}
    (root / "data" / "corpus-info.json").write_text(json.dumps(info))
    write_cache(root / "data" / "cache.pkl", dataset, symbols, special=special, lower_case=lower_case, unk_idx=unk_idx)
    return prefix


def hf_model(prefix: Path, settings: dict[str, Any], tgt_len: int, mem_len: int):
    """transformers 4.37.2's TransfoXLLMHeadModel for ``settings``, in eval mode, holding the checkpoint's
    variables as its ``load_tf_weights_in_transfo_xl`` places them: its own name map
    (``build_tf_to_pytorch_map``) and its transposes. Where that loader fails on the authors' layout (one shared
    r_w_bias, which it reads as a list; a div_val-1 model, whose table and bias it looks for under cluster
    names), the same placement is made here for the names it lacks. Losses come back in token order
    (``keep_order``)."""
    import tensorflow as tf
    import torch
    from transformers.models.deprecated.transfo_xl.configuration_transfo_xl import TransfoXLConfig
    from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import (
        TransfoXLLMHeadModel,
        build_tf_to_pytorch_map,
    )

    config = TransfoXLConfig(
        vocab_size=settings["n_token"],
        cutoffs=list(settings["cutoffs"]),
        d_model=settings["d_model"],
        d_embed=settings["d_embed"],
        n_head=settings["n_head"],
        d_head=settings["d_head"],
        d_inner=settings["d_inner"],
        div_val=settings["div_val"],
        n_layer=settings["n_layer"],
        untie_r=settings["untie_r"],
        tgt_len=tgt_len,
        mem_len=mem_len,
        clamp_len=-1,
        same_length=False,
        dropout=0.0,
        dropatt=0.0,
        layer_norm_epsilon=1e-12,  # tf.contrib.layers.layer_norm's
    )
    config.tie_projs = list(settings["tie_projs"])
    model = TransfoXLLMHeadModel(config)
    if settings["div_val"] == 1:
        names = build_tf_to_pytorch_map(model.transformer, config)  # its layers and r biases
        names = {name: pointer for name, pointer in names.items() if "adaptive_embed/cutoff_" not in name}
        names[SCOPE + "adaptive_embed/lookup_table"] = model.transformer.word_emb.emb_layers[0].weight
        if settings["d_embed"] != settings["d_model"]:
            names[SCOPE + "adaptive_embed/proj_W"] = model.transformer.word_emb.emb_projs[0]
        if settings["cutoffs"]:
            raise ValueError("the oracle reads div_val-1 models with a full softmax (the character models)")
        names[SCOPE + "adaptive_softmax/bias"] = model.crit.out_layers[0].bias
    else:
        names = build_tf_to_pytorch_map(model, config)
    for name, pointer in names.items():
        array = tf.train.load_variable(str(prefix), name)
        if "kernel" in name or "proj" in name:
            array = np.transpose(array)
        pointers = pointer if isinstance(pointer, list) else [pointer]
        if len(pointers) > 1:  # per-layer r biases: row i is layer i's
            for i, each in enumerate(pointers):
                each.data = torch.from_numpy(np.ascontiguousarray(array[i]))
        else:
            if tuple(pointers[0].shape) != array.shape:
                raise ValueError(f"{name}: shape {array.shape}, the model's {tuple(pointers[0].shape)}")
            pointers[0].data = torch.from_numpy(np.ascontiguousarray(array))
    model.tie_weights()
    model.crit.keep_order = True
    return model.eval()
