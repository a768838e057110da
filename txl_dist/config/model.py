"""The architecture of a Transformer-XL language model, and named presets.

Field names follow the authors' code (``n_token``, ``d_model``, ``div_val``, ...) so that their configurations,
ours and HuggingFace's translate by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Annotated, Any, ClassVar, Literal

import pydantic
from pydantic import Field

from txl_dist.config.fields import (
    INT64_MAX,
    TUPLE_AS_LIST,
    Allowed,
    ConfigError,
    Integer,
    NonNegative,
    Number,
    Positive,
    PositiveNumber,
    config_dataclass,
)

MEM_DTYPE_NAMES = ("compute", "float32", "bfloat16", "float16")
"""The dtypes ``model.mem_dtype`` may name for the memory (txl_dist.model.recurrence maps them to torch dtypes);
"compute": that of the hidden states."""

N_TOKEN_FROM_MANIFEST = "n_token_from_manifest"
"""Validation context: n_token is a placeholder (a preset's or the default) that the shards' manifest replaces at
run time, so that cutoffs beyond it are not refused yet (`txl_dist.config.with_manifest_vocab` checks them then)."""

Probability = Annotated[Number, Field(ge=0.0, lt=1.0), Allowed("a probability in [0, 1)")]


@config_dataclass
class ModelConfig:
    """Architecture and segment settings of `TransformerXLLM`, every field checked when an instance is made."""

    SECTION: ClassVar[str] = "model"

    n_token: Annotated[int, Field(ge=1, le=2**32)] = 10000
    """Vocabulary size (at most 2**32: the shards store token ids as uint32). Training runs take it from the
    shards' manifest."""
    n_layer: Positive = 16
    """Number of decoder layers."""
    n_head: Positive = 10
    """Attention heads per layer."""
    d_head: Positive = 41
    """Dimension of each head; n_head * d_head need not equal d_model."""
    d_model: Positive = 410
    """Width of the residual stream (and of the memory)."""
    d_inner: Positive = 2100
    """Hidden width of the position-wise feed-forward network."""
    d_embed: Annotated[
        int | None, Field(ge=1, le=INT64_MAX), Allowed("a positive integer (at most 2**63 - 1) or null (= d_model)")
    ] = None
    """Width of the first embedding cluster before its projection to d_model; None means d_model."""
    div_val: Positive = 1
    """Adaptive embedding/softmax: cluster i has width d_embed // div_val**i. 1 keeps one width for all clusters."""
    cutoffs: Annotated[list[Integer], TUPLE_AS_LIST] = field(default_factory=list)
    """Ascending vocabulary cut points of the adaptive softmax clusters; empty means a full softmax."""
    tie_weight: bool = True
    """Share each output cluster's weight matrix with the matching input embedding cluster."""
    tie_projs: Annotated[list[bool], TUPLE_AS_LIST] | None = None
    """Per cluster (head first): share the output projection with the input projection. None means the authors'
    choice: the head untied, every tail cluster tied."""
    untie_r: bool = False
    """Separate position biases u (r_w_bias) and v (r_r_bias) per layer (the authors' TF code, HuggingFace)
    instead of one pair shared by all layers (the authors' PyTorch code)."""
    pre_lnorm: bool = False
    """Layer norm before each sub-layer (pre-LN) instead of after the residual sum (the paper's post-LN)."""
    dropout: Probability = 0.1
    """Dropout on embeddings, position encodings, sub-layer outputs and the final hidden states."""
    dropatt: Probability = 0.0
    """Dropout on attention probabilities."""
    tgt_len: Positive = 150
    """Tokens per segment (the length of each training window)."""
    mem_len: NonNegative = 150
    """Cached hidden states per layer carried to the next segment; 0 gives a vanilla Transformer."""
    clamp_len: Integer = -1
    """Relative distances beyond this use the encoding of clamp_len; <= 0 disables clamping."""
    same_length: bool = False
    """Every query attends to the same number of keys (mem_len, itself included), as in the paper's evaluation."""
    attn_impl: Literal["auto", "fused", "reference"] = "auto"
    """"reference" (explicit matmuls and softmax), "fused" (scaled_dot_product_attention with the position term
    as an additive bias) or "auto" (fused on CUDA, reference elsewhere; see benchmarks/model_step.py)."""
    compile: bool = False
    """Run the model through ``torch.compile`` (TorchInductor) in training and evaluation. Not part of the
    architecture: checkpoints and exports do not depend on it. The first steps of each new segment shape pay
    for compilation (tens of seconds); see benchmarks/model_step.py --compile for what it gains."""
    mem_dtype: Literal[MEM_DTYPE_NAMES] = "compute"
    """Storage dtype of the memory: "compute" keeps the dtype of the hidden states."""
    init_std: PositiveNumber = 0.02
    """Standard deviation of the normal initialisation of weights, embeddings and position biases."""
    proj_init_std: PositiveNumber = 0.01
    """Standard deviation of the normal initialisation of the adaptive embedding/softmax projections."""
    layer_norm_eps: PositiveNumber = 1e-5
    """Epsilon of every layer norm."""

    @pydantic.model_validator(mode="after")
    def _check_across_fields(self, info: pydantic.ValidationInfo) -> ModelConfig:
        def fail(name: str, allowed: str) -> None:
            raise ConfigError(f"model.{name}", getattr(self, name), allowed)

        if self.same_length and self.mem_len == 0:
            fail("same_length", "false when mem_len is 0 (every query would see no key)")
        if any(b <= a for a, b in zip(self.cutoffs, self.cutoffs[1:])):
            fail("cutoffs", "strictly increasing")
        n_token = self.n_token
        if self.cutoffs and info.context and info.context.get(N_TOKEN_FROM_MANIFEST):
            n_token = max(n_token, self.cutoffs[-1] + 1)
        if self.cutoffs and (self.cutoffs[0] < 1 or self.cutoffs[-1] >= n_token):
            fail("cutoffs", f"between 1 and n_token - 1 = {n_token - 1}")
        dims = self.cluster_dims()
        if self.div_val > 1 and min(dims) < 1:
            fail("div_val", f"small enough that d_embed // div_val**{len(dims) - 1} >= 1 (cluster widths {dims})")
        if self.tie_projs is not None and len(self.tie_projs) != len(self.cutoffs) + 1:
            fail("tie_projs", f"one boolean per cluster: {len(self.cutoffs) + 1} (head + {len(self.cutoffs)} tails)")
        return self

    @property
    def d_embed_resolved(self) -> int:
        return self.d_model if self.d_embed is None else self.d_embed

    @property
    def n_clusters(self) -> int:
        """Tail clusters of the adaptive softmax (0 for a full softmax)."""
        return len(self.cutoffs)

    @property
    def tie_projs_resolved(self) -> list[bool]:
        if self.tie_projs is None:
            return [False] + [True] * len(self.cutoffs)
        return list(self.tie_projs)

    def cluster_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of every cluster, the head (shortlist) first."""
        ends = [0] + self.cutoffs + [self.n_token]
        return list(zip(ends[:-1], ends[1:]))

    def cluster_dims(self) -> list[int]:
        d_embed = self.d_embed_resolved
        return [d_embed // (self.div_val**i) for i in range(len(self.cutoffs) + 1)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(names)}")
        return cls(**data)

    def architecture(self) -> dict[str, Any]:
        """The fields that fix the shapes and meaning of the weights (checked when weights are loaded)."""
        keys = (
            "n_token",
            "n_layer",
            "n_head",
            "d_head",
            "d_model",
            "d_inner",
            "d_embed",
            "div_val",
            "cutoffs",
            "tie_weight",
            "untie_r",
            "pre_lnorm",
        )
        arch = {k: getattr(self, k) for k in keys}
        arch["d_embed"] = self.d_embed_resolved
        arch["tie_projs"] = self.tie_projs_resolved
        return arch


# lm1b settings follow the authors' One Billion Word scripts (base: 18 layers; large: 24 layers). Their train.py
# ties no projection for lm1b (tie_projs = [False] * 4), unlike WikiText-103's [False, True, True, True].
_LM1B_COMMON = dict(
    n_token=793471,
    div_val=4,
    cutoffs=[60000, 100000, 640000],
    tie_weight=True,
    tie_projs=[False] * 4,
    tgt_len=32,
    mem_len=32,
    clamp_len=-1,
    same_length=False,
    pre_lnorm=False,
)

# WikiText-103 follows the authors' run_wt103_base.sh / run_wt103_large.sh and their train.py's adaptive softmax
# for wt103: cutoffs [20000, 40000, 200000], the head's projection untied and the tails' tied. n_token is the
# vocabulary of the training file with <eos> (267,735).
_WT103_COMMON = dict(
    n_token=267735,
    cutoffs=[20000, 40000, 200000],
    tie_weight=True,
    tie_projs=[False, True, True, True],
    clamp_len=-1,
    same_length=False,
    pre_lnorm=False,
)
# enwik8 and text8 follow run_enwik8_*.sh / run_text8_*.sh: a full softmax over the symbols (no --adaptive), the
# output weight tied to the embedding. n_token: 256 byte values for enwik8 (the authors' symbols are the byte
# values that occur, less the newline, which their data drops), 27 characters and the newline for text8.
_CHAR_BASE = dict(
    n_layer=12,
    d_model=512,
    n_head=8,
    d_head=64,
    d_inner=2048,
    dropout=0.1,
    dropatt=0.0,
    tgt_len=512,
    mem_len=512,
    div_val=1,
    cutoffs=[],
    tie_weight=True,
    clamp_len=-1,
    same_length=False,
    pre_lnorm=False,
)
_CHAR_LARGE = dict(
    _CHAR_BASE,
    n_layer=24,
    d_model=1024,
    n_head=8,
    d_head=128,
    d_inner=3072,
    dropout=0.15,
    dropatt=0.15,
    tgt_len=768,
    mem_len=768,
)
ENWIK8_TOKENS, TEXT8_TOKENS = 256, 28

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for unit tests and the 2-rank CPU launcher tests.
    "tiny": dict(
        n_token=1000,
        n_layer=2,
        n_head=2,
        d_head=8,
        d_model=16,
        d_inner=32,
        d_embed=16,
        div_val=2,
        cutoffs=[200, 600],
        dropout=0.0,
        dropatt=0.0,
        tgt_len=8,
        mem_len=8,
    ),
    # A small Transformer-XL for the Penn Treebank (10k words) that trains in minutes on CPUs.
    "ptb_small": dict(
        n_token=10000,
        n_layer=4,
        n_head=4,
        d_head=32,
        d_model=128,
        d_inner=512,
        div_val=1,
        cutoffs=[2000, 4000],
        dropout=0.3,
        dropatt=0.1,
        tgt_len=32,
        mem_len=32,
    ),
    "lm1b_base": dict(
        _LM1B_COMMON, n_layer=18, d_model=1024, n_head=8, d_head=128, d_inner=4096, dropout=0.0, dropatt=0.0
    ),
    "lm1b_large": dict(
        _LM1B_COMMON, n_layer=24, d_model=1280, n_head=16, d_head=80, d_inner=8192, dropout=0.05, dropatt=0.05
    ),
    "wt103_base": dict(
        _WT103_COMMON,
        n_layer=16,
        d_model=410,
        n_head=10,
        d_head=41,
        d_inner=2100,
        div_val=1,
        dropout=0.1,
        dropatt=0.0,
        tgt_len=150,
        mem_len=150,
    ),
    "wt103_large": dict(
        _WT103_COMMON,
        n_layer=18,
        d_model=1024,
        n_head=16,
        d_head=64,
        d_inner=4096,
        div_val=4,
        dropout=0.2,
        dropatt=0.2,
        tgt_len=384,
        mem_len=384,
    ),
    "enwik8_base": dict(_CHAR_BASE, n_token=ENWIK8_TOKENS),
    "enwik8_large": dict(_CHAR_LARGE, n_token=ENWIK8_TOKENS),
    "text8_base": dict(_CHAR_BASE, n_token=TEXT8_TOKENS),
    "text8_large": dict(_CHAR_LARGE, n_token=TEXT8_TOKENS),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named configuration, optionally with some fields changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides}, where=f"preset {name}")
