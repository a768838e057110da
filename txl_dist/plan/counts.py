"""What the model holds and saves, counted from its shape: its parameters, and the bytes of its activations.

The parameters are counted on the module built on PyTorch's meta device (no memory used). The activation terms
are counts of tensors by shape, read from the model's saved tensors (see each docstring): when the model changes,
change the count here. `tests/test_plan.py` holds them to the tensors the model really saves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from txl_dist.config.model import ModelConfig
from txl_dist.model import TransformerXLLM

GiB = 1 << 30
MiB = 1 << 20
FP32 = 4
# glibc returns a freed block to the system only when it was mmap-ed, which blocks of this size or more always
# are: a smaller parameter's fp32 tensor, freed, stays in the heap (`ModelShape.heap_sized`).
GLIBC_MMAP_THRESHOLD_MAX = 32 * MiB


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a model, counted from the module built on the meta device (no memory used)."""

    parameters: int
    """Distinct parameters (tied weights and projections once)."""
    largest_gather: int
    """Elements ZeRO-3 gathers at once for one module: the adaptive softmax (or embedding) with its clusters."""
    heap_sized: int
    """Elements of the parameters whose fp32 tensor is smaller than glibc's largest mmap threshold (32 MiB):
    freed, their memory stays in the process's heap (see `txl_dist.plan.memory.CPU_HEAP_RETAINED`)."""

    @classmethod
    def of(cls, model: ModelConfig) -> ModelShape:
        with torch.device("meta"):
            module = TransformerXLLM(model)
        parameters = sum(p.numel() for p in module.parameters())
        # ZeRO-3 gathers a module's parameters for its forward: the adaptive input or softmax (all clusters), or
        # one decoder layer (the layers' ModuleList is no module that runs).
        groups = [
            sum(p.numel() for p in module.word_emb.parameters()),
            sum(p.numel() for p in module.crit.parameters()),
        ]
        groups += [sum(p.numel() for p in layer.parameters()) for layer in module.layers]
        heap_sized = sum(p.numel() for p in module.parameters() if p.numel() * FP32 < GLIBC_MMAP_THRESHOLD_MAX)
        return cls(parameters, max(groups), heap_sized)


def layer_activation_bytes(model: ModelConfig, micro_batch: int, compute_bytes: int, training: bool = True) -> int:
    """Bytes one decoder layer saves for its backward pass, for micro_batch rows of tgt_len queries over klen =
    mem_len + tgt_len keys (the memory is full after the first segment).

    With L = tgt_len, M = mem_len, K = M + L, B = micro_batch, h = n_head * d_head, S = B * n_head * L * K
    (the attention scores), b the compute dtype's bytes, read from the saved tensors of
    `txl_dist.model.attention` and `transformer.PositionwiseFF` (reference attention; the fused path saves the
    same inputs and no score-sized tensor):

    - the memory fed to its key/value projection (M B d_model) and the segment fed to the query/key/value
      projection, the feed-forward's input and the two layer norms' inputs (4 L B d_model; 6 with dropout: the
      two dropout outputs), and the norms' mean and 1/std (4 L B), all in the compute dtype;
    - q + u and q + v (2 L B h), the keys and values (2 K B h), the projected relative positions ((K + 1) h: one
      zero row for the shift, shared by the batch) and the attention output fed to o_net (L B h);
    - the softmax probabilities (S, fp32), their cast to the compute dtype for the product with the values
      (S b, under bf16/fp16 only); with attention dropout also its fp32 mask and output (2 S fp32 more, the
      output being the cast under bf16/fp16);
    - the feed-forward's ReLU output L B d_inner (with dropout its output and mask too: 3 L B d_inner).

    `tests/test_plan.py` holds this count to the saved tensors of the model within 5%.
    """
    L, M, B = model.tgt_len, model.mem_len, micro_batch
    K = M + L
    h, b = model.n_head * model.d_head, compute_bytes
    scores = B * model.n_head * L * K
    dropout = training and model.dropout > 0
    attention_dropout = training and model.dropatt > 0
    total = M * B * model.d_model * b + (6 if dropout else 4) * L * B * model.d_model * b + 4 * L * B * b
    total += (3 * L * B + 2 * K * B + K + 1) * h * b
    if attention_dropout:
        total += scores * (2 * FP32 + (b if b != FP32 else FP32))
    else:
        total += scores * (FP32 + (b if b != FP32 else 0))
    total += (3 if dropout else 1) * L * B * model.d_inner * b
    return total


# The word law behind `tail_rows`: P(rank >= r) proportional to (r + 8)^(-0.47), the law that gives a synthetic
# corpus One Billion Word's vocabulary statistics (`benchmarks.corpora.synthetic_lm1b`), and a margin of 4 on each tail
# cluster's share: real text has heavier tails than the law (1BW's out-of-vocabulary rate is about 0.3% where
# the law gives 0.17%) and a batch can be richer in rare words than the average.
WORD_LAW_EXPONENT, WORD_LAW_OFFSET, TAIL_MARGIN = 1.47, 8.0, 4.0


def tail_rows(model: ModelConfig, rows: int) -> list[int]:
    """Rows each tail cluster of the adaptive softmax computes for ``rows`` targets. The softmax of a tail
    cluster runs only on the targets inside it, so this depends on the text: here the share of the cluster's
    ids [start, end) under the word law above (ids are ranks by frequency), times TAIL_MARGIN. For
    lm1b_base's cutoffs that is 1.4%, 2.9% and 0.2% of the rows. (Should the adaptive softmax come to run every
    tail cluster on every row, return [rows] * n_clusters.)"""
    power = 1.0 - WORD_LAW_EXPONENT

    def at_least(rank: int) -> float:  # unnormalised P(rank >= r) over ranks 1..n_token
        return (rank + WORD_LAW_OFFSET) ** power - (model.n_token + 1 + WORD_LAW_OFFSET) ** power

    total = at_least(1)
    shares = [(at_least(start + 1) - at_least(end + 1)) / total for start, end in model.cluster_bounds()[1:]]
    return [min(rows, math.ceil(rows * TAIL_MARGIN * share)) for share in shares]


def head_activation_bytes(
    model: ModelConfig, micro_batch: int, compute_bytes: int, rows: Sequence[int] | None = None
) -> int:
    """Bytes the adaptive input and the adaptive softmax save for the backward pass of one micro-batch
    (N = micro_batch * tgt_len targets; C0 = cutoffs[0] + n_clusters head logits; E_i the width of cluster i):

    - input: the tokens' embeddings of every cluster before their projection (N E_i), compute dtype, and the
      relative position embeddings all layers share (klen d_model);
    - head cluster: the hidden states and their projection (N d_model + N E_0), compute dtype, and its
      log-probabilities (N C0, fp32); the head's weight and the cluster logits' weight are used in place;
    - each tail cluster over n_i rows (``rows``, default `tail_rows`): the rows' hidden states and projection
      (n_i (d_model + E_i)), compute dtype, and its log-probabilities (n_i S_i, fp32).
    """
    N, b = micro_batch * model.tgt_len, compute_bytes
    dims = model.cluster_dims()
    bounds = model.cluster_bounds()
    head_logits = bounds[0][1] - bounds[0][0] + model.n_clusters
    total = sum(N * dim for dim in dims) * b + (model.mem_len + model.tgt_len) * model.d_model * b
    total += (N * model.d_model + N * dims[0]) * b + N * head_logits * FP32
    for count, (start, end), dim in zip(tail_rows(model, N) if rows is None else rows, bounds[1:], dims[1:]):
        total += count * (model.d_model + dim) * b + count * (end - start) * FP32
    return total


def head_transient_bytes(model: ModelConfig, micro_batch: int, compute_bytes: int) -> int:
    """The largest short-lived block on top of the saved tensors, at the start of the backward pass: the
    gradient of the head cluster's logits, written in fp32 while the log-probabilities are still held (N C0),
    and its copy in the compute dtype when that is narrower (N C0, compute dtype), and the gradient of the
    head's weight with the cluster logits' rows (C0 E_0, compute dtype).
    Measured on CPU with PyTorch's profiler (benchmarks/plan_check.py)."""
    N = micro_batch * model.tgt_len
    head_logits = model.cluster_bounds()[0][1] + model.n_clusters
    logits_grad = N * head_logits * (FP32 + (compute_bytes if compute_bytes < FP32 else 0))
    return logits_grad + head_logits * model.cluster_dims()[0] * compute_bytes


def eval_forward_bytes(model: ModelConfig, batch: int, compute_bytes: int) -> int:
    """The largest transient of an evaluation forward (no autograd: one layer's tensors live at a time), for
    ``batch`` streams of tgt_len queries over K = mem_len + tgt_len keys (the model's segment settings are the
    evaluation's): the attention scores and their softmax (2 S fp32, S = batch n_head tgt_len K, and their cast
    under bf16/fp16), the memory and segment concatenated, their keys and values and the projected positions
    (K batch d_model + 2 K batch h + 2 (K + 1) h, compute dtype), and the head cluster's logits and
    log-probabilities over batch x tgt_len rows (2 N C0 fp32)."""
    L, K, b = model.tgt_len, model.mem_len + model.tgt_len, compute_bytes
    h = model.n_head * model.d_head
    scores = batch * model.n_head * L * K
    total = scores * (2 * FP32 + (b if b != FP32 else 0))
    total += (K * batch * model.d_model + 2 * K * batch * h + 2 * (K + 1) * h) * b
    head_logits = model.cluster_bounds()[0][1] + model.n_clusters
    return total + 2 * batch * L * head_logits * FP32
