"""The architecture of a Transformer-XL language model, and named presets.

Field names follow the authors' code (``n_token``, ``d_model``, ``div_val``, ...) so that their configurations,
ours and HuggingFace's translate by name. Each field declares its roles beside it (`Roles`: architecture, segment
setting, its key in an export's config.json and in a hub folder's); the lists the export, the hub folder, evaluation
and the architecture check use are derived from them (`field_roles`, `MODEL_FIELD_ROLES`).
"""

from __future__ import annotations

import dataclasses
import functools
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
    UnknownKeyError,
    config_dataclass,
)

MEM_DTYPE_NAMES = ("compute", "float32", "bfloat16", "float16")
"""The dtypes ``model.mem_dtype`` may name for the memory (txl_dist.model.recurrence maps them to torch dtypes);
"compute": that of the hidden states."""

N_TOKEN_FROM_MANIFEST = "n_token_from_manifest"
"""Validation context: n_token is a placeholder (a preset's or the default) that the shards' manifest replaces at
run time, so that cutoffs beyond it are not refused yet (`txl_dist.config.with_manifest_vocab` checks them then)."""

Probability = Annotated[Number, Field(ge=0.0, lt=1.0), Allowed("a probability in [0, 1)")]

ARCHITECTURE = "architecture"
"""Role: the field fixes the shapes or the meaning of the weights; a checkpoint of another value is refused on
resume, and weights are loaded into a model of the same value only (`ModelConfig.architecture`)."""
SEGMENT = "segment"
"""Role: a segment or evaluation setting; evaluation and decoding may override it for the same weights
(``EVAL_SETTINGS`` of `txl_dist.export`)."""
AUTHORS = "authors"
"""Role: written to an export's config.json under the authors' argument name; a config.json without it is
refused."""
EXTRA = "extra"
"""Role: written to an export's config.json as one of our fields; ModelConfig's default when absent."""
KINDS = (ARCHITECTURE, SEGMENT, AUTHORS, EXTRA)


class Roles:
    """``Annotated`` metadata of every `ModelConfig` field: what the field is for, declared once beside it.

    ``kinds``: any of `KINDS`. ``config_key``: the field's place among the keys of an export's config.json (it is
    written there; AUTHORS or EXTRA says under whose name). ``hub_key``: its place among the model's keys in the
    config.json of a HuggingFace hub folder (`txl_dist.convert.hub`), made from the export, so only a field of
    the export may have one. The places only order the keys of those files, which stay as they were written."""

    __slots__ = ("kinds", "config_key", "hub_key")

    def __init__(self, *kinds: str, config_key: int | None = None, hub_key: int | None = None) -> None:
        self.kinds, self.config_key, self.hub_key = frozenset(kinds), config_key, hub_key
        problem = _roles_problem(self)
        if problem:
            raise TypeError(f"Roles{(*kinds,)} (config_key={config_key}, hub_key={hub_key}): {problem}")

    def __repr__(self) -> str:
        kinds = [kind for kind in KINDS if kind in self.kinds]
        return f"Roles({kinds}, config_key={self.config_key}, hub_key={self.hub_key})"


def _roles_problem(roles: Roles) -> str | None:
    """What is inconsistent in one field's roles, or None."""
    unknown = sorted(roles.kinds - set(KINDS))
    if unknown:
        return f"unknown role(s) {unknown}; roles are {list(KINDS)}"
    if {ARCHITECTURE, SEGMENT} <= roles.kinds:
        return "a field fixes the weights (architecture) or may be overridden at evaluation (segment), not both"
    if {AUTHORS, EXTRA} <= roles.kinds:
        return "config.json names a field as the authors do (authors) or as we do (extra), not both"
    exported = bool(roles.kinds & {AUTHORS, EXTRA})
    if exported != (roles.config_key is not None):
        return "a field written to config.json (authors or extra) has a config_key, and only such a field"
    if roles.kinds & {ARCHITECTURE, SEGMENT} and not exported:
        return "an architecture or segment field must be written to config.json (authors or extra)"
    if roles.hub_key is not None and not exported:
        return "the hub folder is made from the export: a field with a hub_key must be in config.json"
    return None


@dataclasses.dataclass(frozen=True)
class FieldRoles:
    """The field names of each role, derived from the `Roles` of a config class (`field_roles`)."""

    architecture: tuple[str, ...]
    """In field order: what `ModelConfig.architecture` compares."""
    segment: tuple[str, ...]
    """In field order: the settings evaluation may override."""
    authors: tuple[str, ...]
    """In config.json order: the authors' names."""
    extra: tuple[str, ...]
    """In config.json order: our names."""
    hub: tuple[str, ...]
    """In the hub config.json's order."""


def same_length_problem(same_length: bool, mem_len: int, mem_len_name: str = "mem_len") -> str | None:
    """The one rule that joins same_length and mem_len: with same_length every query sees mem_len keys, so it
    needs a memory. What same_length must be when the two disagree (for the message), else None. The model's
    fields, the eval section's resolved settings and `txl_dist.model.recurrence.SegmentSettings` all ask it."""
    if same_length and mem_len == 0:
        return f"false when {mem_len_name} is 0 (every query would see no key)"
    return None


@config_dataclass
class ModelConfig:
    """Architecture and segment settings of `TransformerXLLM`, every field checked when an instance is made."""

    SECTION: ClassVar[str] = "model"

    n_token: Annotated[int, Field(ge=1, le=2**32), Roles(ARCHITECTURE, AUTHORS, config_key=0, hub_key=0)] = 10000
    """Vocabulary size (at most 2**32: the shards store token ids as uint32). Training runs take it from the
    shards' manifest."""
    n_layer: Annotated[Positive, Roles(ARCHITECTURE, AUTHORS, config_key=1, hub_key=1)] = 16
    """Number of decoder layers."""
    n_head: Annotated[Positive, Roles(ARCHITECTURE, AUTHORS, config_key=2, hub_key=2)] = 10
    """Attention heads per layer."""
    d_head: Annotated[Positive, Roles(ARCHITECTURE, AUTHORS, config_key=4, hub_key=3)] = 41
    """Dimension of each head; n_head * d_head need not equal d_model."""
    d_model: Annotated[Positive, Roles(ARCHITECTURE, AUTHORS, config_key=3, hub_key=4)] = 410
    """Width of the residual stream (and of the memory)."""
    d_inner: Annotated[Positive, Roles(ARCHITECTURE, AUTHORS, config_key=5, hub_key=5)] = 2100
    """Hidden width of the position-wise feed-forward network."""
    d_embed: Annotated[
        int | None,
        Field(ge=1, le=INT64_MAX),
        Allowed("a positive integer (at most 2**63 - 1) or null (= d_model)"),
        Roles(ARCHITECTURE, AUTHORS, config_key=6, hub_key=20),
    ] = None
    """Width of the first embedding cluster before its projection to d_model; None means d_model."""
    div_val: Annotated[Positive, Roles(ARCHITECTURE, AUTHORS, config_key=7, hub_key=6)] = 1
    """Adaptive embedding/softmax: cluster i has width d_embed // div_val**i. 1 keeps one width for all clusters."""
    cutoffs: Annotated[list[Integer], TUPLE_AS_LIST, Roles(ARCHITECTURE, AUTHORS, config_key=8, hub_key=7)] = field(
        default_factory=list
    )
    """Ascending vocabulary cut points of the adaptive softmax clusters; empty means a full softmax."""
    tie_weight: Annotated[bool, Roles(ARCHITECTURE, AUTHORS, config_key=9, hub_key=8)] = True
    """Share each output cluster's weight matrix with the matching input embedding cluster."""
    tie_projs: Annotated[
        Annotated[list[bool], TUPLE_AS_LIST] | None, Roles(ARCHITECTURE, AUTHORS, config_key=10, hub_key=21)
    ] = None
    """Per cluster (head first): share the output projection with the input projection. None means the authors'
    choice: the head untied, every tail cluster tied."""
    untie_r: Annotated[bool, Roles(ARCHITECTURE, AUTHORS, config_key=11, hub_key=9)] = False
    """Separate position biases u (r_w_bias) and v (r_r_bias) per layer (the authors' TF code, HuggingFace)
    instead of one pair shared by all layers (the authors' PyTorch code)."""
    pre_lnorm: Annotated[bool, Roles(ARCHITECTURE, AUTHORS, config_key=12, hub_key=10)] = False
    """Layer norm before each sub-layer (pre-LN) instead of after the residual sum (the paper's post-LN)."""
    dropout: Annotated[Probability, Roles(SEGMENT, AUTHORS, config_key=17, hub_key=11)] = 0.1
    """Dropout on embeddings, position encodings, sub-layer outputs and the final hidden states."""
    dropatt: Annotated[Probability, Roles(SEGMENT, AUTHORS, config_key=18, hub_key=12)] = 0.0
    """Dropout on attention probabilities."""
    tgt_len: Annotated[Positive, Roles(SEGMENT, AUTHORS, config_key=13, hub_key=13)] = 150
    """Tokens per segment (the length of each training window)."""
    mem_len: Annotated[NonNegative, Roles(SEGMENT, AUTHORS, config_key=14, hub_key=14)] = 150
    """Cached hidden states per layer carried to the next segment; 0 gives a vanilla Transformer."""
    clamp_len: Annotated[Integer, Roles(SEGMENT, AUTHORS, config_key=15, hub_key=15)] = -1
    """Relative distances beyond this use the encoding of clamp_len; <= 0 disables clamping."""
    same_length: Annotated[bool, Roles(SEGMENT, AUTHORS, config_key=16, hub_key=16)] = False
    """Every query attends to the same number of keys (mem_len, itself included), as in the paper's evaluation."""
    attn_impl: Annotated[Literal["auto", "fused", "reference"], Roles(SEGMENT, EXTRA, config_key=19)] = "auto"
    """"reference" (explicit matmuls and softmax), "fused" (scaled_dot_product_attention with the position term
    as an additive bias) or "auto" (fused on CUDA, reference elsewhere; see benchmarks/model_step.py)."""
    compile: Annotated[bool, Roles()] = False
    """Run the model through ``torch.compile`` (TorchInductor) in training and evaluation. Not part of the
    architecture: checkpoints and exports do not depend on it. The first steps of each new segment shape pay
    for compilation (tens of seconds); see benchmarks/model_step.py --compile for what it gains."""
    mem_dtype: Annotated[Literal[MEM_DTYPE_NAMES], Roles(SEGMENT, EXTRA, config_key=20)] = "compute"
    """Storage dtype of the memory: "compute" keeps the dtype of the hidden states."""
    init_std: Annotated[PositiveNumber, Roles(EXTRA, config_key=21, hub_key=18)] = 0.02
    """Standard deviation of the normal initialisation of weights, embeddings and position biases."""
    proj_init_std: Annotated[PositiveNumber, Roles(EXTRA, config_key=22, hub_key=19)] = 0.01
    """Standard deviation of the normal initialisation of the adaptive embedding/softmax projections."""
    layer_norm_eps: Annotated[PositiveNumber, Roles(EXTRA, config_key=23, hub_key=17)] = 1e-5
    """Epsilon of every layer norm."""

    @pydantic.model_validator(mode="after")
    def _check_across_fields(self, info: pydantic.ValidationInfo) -> ModelConfig:
        def fail(name: str, allowed: str) -> None:
            raise ConfigError(f"model.{name}", getattr(self, name), allowed)

        problem = same_length_problem(self.same_length, self.mem_len)
        if problem:
            fail("same_length", problem)
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
    def from_dict(cls, data: dict[str, Any], where: str | None = None) -> ModelConfig:
        """The config of the fields in ``data``; an unknown key's error names ``where`` (a file, a preset)."""
        try:
            return cls(**data)
        except UnknownKeyError as error:
            raise error.with_source(f"in {where}" if where else None) from None

    def resolved_dict(self) -> dict[str, Any]:
        """`to_dict` with ``d_embed`` and ``tie_projs`` resolved: the values an export and the architecture hold."""
        data = self.to_dict()
        data["d_embed"] = self.d_embed_resolved
        data["tie_projs"] = self.tie_projs_resolved
        return data

    def architecture(self) -> dict[str, Any]:
        """The fields of role ARCHITECTURE, resolved: they fix the shapes and meaning of the weights (checked when
        weights are loaded, and on resume against the checkpoint's COMPLETE.json)."""
        values = self.resolved_dict()
        return {name: values[name] for name in field_roles(type(self)).architecture}


@functools.cache
def field_roles(cls: type = ModelConfig) -> FieldRoles:
    """The field names of each role of ``cls`` (ModelConfig or a subclass), from the `Roles` beside each field.
    TypeError when a field declares no Roles or two fields share a place in a file."""
    declared: dict[str, Roles] = {}
    for name, info in cls.__pydantic_fields__.items():
        found = [item for item in info.metadata if isinstance(item, Roles)]
        if len(found) != 1:
            raise TypeError(f"{cls.__name__}.{name}: declare its roles once, as Annotated[..., Roles(...)]")
        declared[name] = found[0]

    def names(kind: str) -> tuple[str, ...]:
        return tuple(name for name, roles in declared.items() if kind in roles.kinds)

    def in_file_order(attribute: str) -> list[str]:
        placed = {name: getattr(roles, attribute) for name, roles in declared.items()}
        placed = {name: key for name, key in placed.items() if key is not None}
        keys = sorted(placed.values())
        if len(set(keys)) != len(keys):
            shared = sorted(name for name, key in placed.items() if keys.count(key) > 1)
            raise TypeError(f"{cls.__name__}: fields {shared} share a {attribute}")
        return sorted(placed, key=placed.__getitem__)

    config_order = in_file_order("config_key")
    return FieldRoles(
        architecture=names(ARCHITECTURE),
        segment=names(SEGMENT),
        authors=tuple(name for name in config_order if AUTHORS in declared[name].kinds),
        extra=tuple(name for name in config_order if EXTRA in declared[name].kinds),
        hub=tuple(in_file_order("hub_key")),
    )


MODEL_FIELD_ROLES = field_roles(ModelConfig)
"""The roles of ModelConfig's fields (checked when this module is imported)."""


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
