"""Model FLOPs of a training step of Transformer-XL, term by term, as `txl_dist.model` computes them.

The formula is written out in docs/metrics.md (Model FLOPs); each term below is one line of it. Counted are the
matrix products (a multiply and an add are 2 FLOPs), as `torch.utils.flop_counter.FlopCounterMode` counts them
(tests/test_flops.py holds the two together); layer norms, softmaxes, activations, dropout and bias additions
are left out, as they are in MFU figures elsewhere (PaLM, torchtitan, Lightning, Composer). Embedding lookups
are 0 FLOPs; the projections of the adaptive embedding count.

Backward: 2 x forward for a matmul whose inputs both need a gradient (one matmul for the input's gradient, one
for the weight's); 1 x forward where the input needs none, whose backward computes the weight's gradient only:
the position projection r_net (its input is the fixed sinusoid R) and the memory's keys and values (the memory is
detached), except with pre-LN, where the memory passes through the layer norm first and its gain and bias need
the gradient of the projection's input (2 x then).

Symbols (per micro-batch): B streams, qlen = tgt_len queries, mlen memory positions (mem_len once the memory is
full), klen = qlen + mlen keys, H heads of width D, d = d_model, L layers. The adaptive softmax computes a tail
cluster only for the targets in it, so its rows are N x p_i for N = B x qlen targets and p_i the fraction of
targets in cluster i (``tail_fractions``): measured over a step's targets (`cluster_counts`) it is that step's
exact count; taken from the unigram frequencies of the training split it is the expected count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from txl_dist.config.model import ModelConfig

MATMUL = 2
"""FLOPs per multiply-add."""
BACKWARD_BOTH = 2
"""Backward / forward of a matmul whose input and weight both need gradients."""
BACKWARD_WEIGHT_ONLY = 1
"""Backward / forward of a matmul whose input needs no gradient (detached memory, the sinusoid R)."""

GROUPS = {
    "attention": (
        "qkv_projection",
        "memory_kv_projection",
        "position_projection",
        "attention_content",
        "attention_position",
        "attention_values",
        "output_projection",
    ),
    "feed_forward": ("feed_forward",),
    "embedding": ("embedding_projection",),
    "softmax": ("softmax_head", "softmax_tail"),
}
"""The terms by part of the model, for the start line's breakdown."""


def _train(forward: float, backward_ratio: int) -> float:
    """Forward plus backward FLOPs of a matmul of ``forward`` FLOPs."""
    return forward * (1 + backward_ratio)


def _cluster_widths(config: ModelConfig) -> list[tuple[int, int]]:
    """(embedding width, number of words) of each cluster, head first (one cluster: the whole vocabulary)."""
    ends = [0, *config.cutoffs, config.n_token]
    d_embed = config.d_embed_resolved
    return [
        (d_embed if config.div_val == 1 else d_embed // config.div_val**i, end - start)
        for i, (start, end) in enumerate(zip(ends[:-1], ends[1:]))
    ]


def _has_projection(config: ModelConfig, width: int) -> bool:
    """Whether a cluster of embedding ``width`` is projected to d_model (always with div_val > 1)."""
    return config.div_val != 1 or width != config.d_model


def layer_terms(config: ModelConfig, batch: int, qlen: int, mlen: int) -> dict[str, float]:
    """Forward + backward FLOPs of the n_layer decoder layers for one micro-batch, by term."""
    d, hd, klen = config.d_model, config.n_head * config.d_head, qlen + mlen
    queries = batch * qlen  # rows of the segment
    memory_backward = BACKWARD_BOTH if config.pre_lnorm else BACKWARD_WEIGHT_ONLY
    per_layer = {
        # q, k, v of the segment: [B*qlen, d] x [d, 3HD]
        "qkv_projection": _train(MATMUL * queries * d * 3 * hd, BACKWARD_BOTH),
        # k, v of the memory: [B*mlen, d] x [d, 2HD]; the memory is detached, but with pre-LN its layer norm's
        # gain and bias need the gradient of the projection's input
        "memory_kv_projection": _train(MATMUL * batch * mlen * d * 2 * hd, memory_backward),
        # r_net over the klen relative positions, once for the whole batch: [klen, d] x [d, HD]
        "position_projection": _train(MATMUL * klen * d * hd, BACKWARD_WEIGHT_ONLY),
        # AC = (q + u) k^T: [H*B, qlen, D] x [H*B, D, klen]
        "attention_content": _train(MATMUL * queries * klen * hd, BACKWARD_BOTH),
        # BD = (q + v) (W_R R)^T over klen distances and the zero row of the relative shift: klen + 1 columns
        "attention_position": _train(MATMUL * queries * (klen + 1) * hd, BACKWARD_BOTH),
        # softmax(AC + BD) v: [H*B, qlen, klen] x [H*B, klen, D]
        "attention_values": _train(MATMUL * queries * klen * hd, BACKWARD_BOTH),
        # o_net: [B*qlen, HD] x [HD, d]
        "output_projection": _train(MATMUL * queries * hd * d, BACKWARD_BOTH),
        # two linear maps d -> d_inner -> d
        "feed_forward": _train(MATMUL * queries * 2 * d * config.d_inner, BACKWARD_BOTH),
    }
    return {name: config.n_layer * value for name, value in per_layer.items()}


def embedding_terms(config: ModelConfig, batch: int, qlen: int) -> dict[str, float]:
    """Forward + backward FLOPs of the adaptive input's projections: with div_val > 1 every cluster embeds and
    projects every token (`AdaptiveEmbedding.forward` selects the right cluster afterwards, with no
    data-dependent shapes); with div_val == 1 one projection, where d_embed differs from d_model."""
    widths = [width for width, _ in _cluster_widths(config)]
    if config.div_val == 1:
        widths = widths[:1]
    tokens = batch * qlen
    flops = sum(MATMUL * tokens * width * config.d_model for width in widths if _has_projection(config, width))
    return {"embedding_projection": _train(flops, BACKWARD_BOTH)}


def softmax_terms(config: ModelConfig, targets: float, tail_fractions: Sequence[float]) -> dict[str, float]:
    """Forward + backward FLOPs of the projected adaptive softmax for ``targets`` rows: the head (its projection,
    its words and one logit per tail cluster) over every row, tail cluster i over ``targets * tail_fractions[i]``
    rows (its projection and its words)."""
    clusters = _cluster_widths(config)
    n_tails = len(clusters) - 1
    if len(tail_fractions) != n_tails:
        raise ValueError(f"tail_fractions: one fraction per tail cluster ({n_tails}), got {len(tail_fractions)}")

    def cluster(rows: float, width: int, outputs: int) -> float:
        projection = MATMUL * rows * config.d_model * width if _has_projection(config, width) else 0
        return _train(projection + MATMUL * rows * width * outputs, BACKWARD_BOTH)

    head_width, head_words = clusters[0]
    tail = sum(
        cluster(targets * fraction, width, words) for fraction, (width, words) in zip(tail_fractions, clusters[1:])
    )
    return {"softmax_head": cluster(targets, head_width, head_words + n_tails), "softmax_tail": tail}


def step_terms(
    config: ModelConfig,
    batch: int,
    tail_fractions: Sequence[float] = (),
    qlen: int | None = None,
    mlen: int | None = None,
) -> dict[str, float]:
    """Forward + backward FLOPs of one micro-batch of ``batch`` streams, by term (docs/metrics.md). ``qlen``
    defaults to tgt_len, ``mlen`` to mem_len (a full memory); ``tail_fractions``: the fraction of the targets
    in each tail cluster (none without cutoffs)."""
    qlen = config.tgt_len if qlen is None else qlen
    mlen = config.mem_len if mlen is None else mlen
    return {
        **embedding_terms(config, batch, qlen),
        **layer_terms(config, batch, qlen, mlen),
        **softmax_terms(config, batch * qlen, tail_fractions),
    }


def flops_per_token(terms: dict[str, float], batch: int, qlen: int) -> float:
    """The training FLOPs per target token of a micro-batch's ``terms`` (`step_terms`)."""
    return sum(terms.values()) / (batch * qlen)


def breakdown(terms: dict[str, float]) -> dict[str, float]:
    """``terms`` summed by part of the model (`GROUPS`)."""
    return {group: sum(terms[name] for name in names) for group, names in GROUPS.items()}


def cluster_counts(targets: torch.Tensor, cutoffs: Sequence[int]) -> torch.Tensor:
    """The number of ``targets`` (any shape) in each cluster, head first: int64 [len(cutoffs) + 1]."""
    bounds = torch.tensor(list(cutoffs), dtype=targets.dtype, device=targets.device)
    cluster = torch.bucketize(targets.reshape(-1), bounds, right=True)
    return torch.bincount(cluster, minlength=len(cutoffs) + 1)


def tail_fractions(counts: Sequence[float]) -> list[float]:
    """The fraction of targets in each tail cluster from `cluster_counts` (summed over any number of batches)."""
    total = sum(counts)
    return [count / total for count in counts[1:]] if total else [0.0] * (len(counts) - 1)
