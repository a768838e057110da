"""Adaptive input embedding and projected adaptive log-softmax (Baevski & Auli 2019; Grave et al. 2017).

The vocabulary is cut into clusters at ``cutoffs``: a head (the frequent words) and tail clusters. With
``div_val > 1`` cluster i has its own embedding width ``d_embed // div_val**i`` and a projection to/from
``d_proj``; with ``div_val == 1`` one matrix serves all clusters. The softmax head scores the head words plus one
logit per tail cluster; a tail word's log-probability is its cluster's head log-probability plus its
log-probability within the cluster.

Parameter names follow the authors' code (``emb_layers``, ``emb_projs``, ``out_layers``, ``out_projs``,
``cluster_weight``, ``cluster_bias``). Tail cluster i (1-based) uses row ``i - 1`` of ``cluster_weight``, as
HuggingFace's port does; the authors' PyTorch code reads it from row ``n_clusters - i`` (their
``head_logprob[:, -i]``), which `txl_dist.convert.original` accounts for.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class ClusterRows:
    """For `ProjectedAdaptiveLogSoftmax.forward`: the positions of the targets in each tail cluster, as index
    tensors on the device of the hidden states (their lengths known on the host)."""

    rows: list[torch.Tensor]


def _pads_rows(hidden: torch.Tensor) -> bool:
    """Whether the tail clusters' row counts are rounded up (`_padded`): for bf16/fp16 matmuls on CPU, where
    oneDNN compiles a kernel for every new matrix shape (several times longer than running it) and a tail
    cluster's row count changes with every batch: three new shapes per
    cluster per step, forward and backward, would cost more than the step. Rounding keeps a few shapes per
    octave, and the kernels are compiled once."""
    if hidden.device.type != "cpu":
        return False
    return hidden.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cpu")


def _padded(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` followed by copies of rows[0] up to the next multiple of an eighth of the largest power of two not
    above their number (at most 12.5% more rows; 8 lengths per octave)."""
    n = rows.shape[0]
    if n <= 16:
        return rows
    step = 1 << (n.bit_length() - 4)
    extra = -n % step
    return torch.cat([rows, rows[:1].expand(extra)]) if extra else rows


class _PickedNLL(torch.autograd.Function):
    """``-log_softmax(logits.float(), -1).gather(1, index[:, None])[:, 0]``, with a shorter backward.

    The gradient of the logits is ``g * (softmax - onehot)``, written into one buffer: the exponential of the saved
    log-probabilities, a product and a scatter, in place. Composed, autograd would fill an [N, V] zero gradient,
    scatter into it and run log-softmax's backward over it: two more passes over the largest tensors of a small
    model's step. The forward and
    what it saves (the float32 log-probabilities) are the composed version's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        logprob = F.log_softmax(logits.float(), dim=-1)
        ctx.save_for_backward(logprob, index)
        ctx.logits_dtype = logits.dtype
        return -logprob.gather(1, index.unsqueeze(1)).squeeze(1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logprob, index = ctx.saved_tensors
        grad = grad.to(logprob.dtype).unsqueeze(1)
        logits_grad = torch.exp(logprob).mul_(grad)
        logits_grad.scatter_add_(1, index.unsqueeze(1), -grad)
        return logits_grad.to(ctx.logits_dtype), None


def picked_nll(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (any float dtype), index [N] -> -log_softmax(logits)[n, index[n]] [N], float32."""
    return _PickedNLL.apply(logits, index)


def _bounds(n_token: int, cutoffs: list[int]) -> list[tuple[int, int]]:
    ends = [0] + list(cutoffs) + [n_token]
    return list(zip(ends[:-1], ends[1:]))


class AdaptiveEmbedding(nn.Module):
    """Token ids (any shape) -> embeddings [..., d_proj], scaled by sqrt(d_proj) as in the authors' code."""

    def __init__(self, n_token: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int):
        super().__init__()
        self.n_token, self.d_embed, self.d_proj, self.div_val = n_token, d_embed, d_proj, div_val
        self.bounds = _bounds(n_token, cutoffs)
        self.emb_scale = d_proj**0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(n_token, d_embed))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i, (start, end) in enumerate(self.bounds):
                d_emb_i = d_embed // (div_val**i)
                self.emb_layers.append(nn.Embedding(end - start, d_emb_i))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_emb_i)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.div_val == 1:
            embed = self.emb_layers[0](tokens)
            if len(self.emb_projs) > 0:
                embed = F.linear(embed, self.emb_projs[0])
            return embed * self.emb_scale
        # Every cluster embeds every token at a clamped local index and the right cluster is selected per token:
        # no data-dependent shapes, no host synchronisation, exact (the other clusters contribute zeros).
        embed = None
        for i, (start, end) in enumerate(self.bounds):
            in_cluster = (tokens >= start) & (tokens < end)
            local = (tokens - start).clamp(0, end - start - 1)
            emb_i = F.linear(self.emb_layers[i](local), self.emb_projs[i])
            part = torch.where(in_cluster.unsqueeze(-1), emb_i, torch.zeros((), dtype=emb_i.dtype, device=emb_i.device))
            embed = part if embed is None else embed + part
        return embed * self.emb_scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Hidden states [N, d_proj] -> negative log-likelihood [N] of targets, or full log-probabilities [N, n_token].

    Logits may be computed in the weights' dtype; the softmax and everything after it is float32.
    """

    def __init__(self, n_token: int, d_embed: int, d_proj: int, cutoffs: list[int], div_val: int):
        super().__init__()
        self.n_token, self.d_embed, self.d_proj, self.div_val = n_token, d_embed, d_proj, div_val
        self.bounds = _bounds(n_token, cutoffs)
        self.shortlist_size = self.bounds[0][1]
        self.n_clusters = len(cutoffs)
        # The cluster boundaries as tensors: on the host for `cluster_rows`, and as a (non-persistent) buffer that
        # follows the module to its device, since building one there per step would wait for the device.
        self._cutoffs_host = torch.tensor(list(cutoffs), dtype=torch.long)
        self.register_buffer("cutoff_ends", self._cutoffs_host.clone(), persistent=False)
        if self.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.empty(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.empty(self.n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if div_val == 1:
            for _ in self.bounds:
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)) if d_proj != d_embed else None)
            self.out_layers.append(nn.Linear(d_embed, n_token))
        else:
            for i, (start, end) in enumerate(self.bounds):
                d_emb_i = d_embed // (div_val**i)
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_emb_i)))
                self.out_layers.append(nn.Linear(d_emb_i, end - start))

    def _cluster_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight, bias) of every cluster. With div_val == 1 the clusters are pieces of one matrix, taken by one
        split (whose backward writes the gradient once, where per-cluster slices would each add a zero-filled
        copy of the whole matrix)."""
        if self.div_val == 1:
            sizes = [end - start for start, end in self.bounds]
            return list(zip(self.out_layers[0].weight.split(sizes), self.out_layers[0].bias.split(sizes)))
        return [(layer.weight, layer.bias) for layer in self.out_layers]

    def _cluster_weight(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) of cluster i alone (for inference, which may not need every cluster)."""
        if self.div_val == 1:
            start, end = self.bounds[i]
            layer = self.out_layers[0]
            return layer.weight.narrow(0, start, end - start), layer.bias.narrow(0, start, end - start)
        return self.out_layers[i].weight, self.out_layers[i].bias

    def _cluster_logits(self, hidden: torch.Tensor, i: int, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Logits of cluster i's words; for i == 0 the head words', then one logit per tail cluster."""
        proj = self.out_projs[i]
        if proj is not None:
            hidden = F.linear(hidden, proj.t())
        if i > 0 or self.n_clusters == 0:
            return F.linear(hidden, weight, bias)
        if hidden.shape[0] >= hidden.shape[-1]:
            # More rows than the head's width (training): copying the weights [head words + clusters, width] costs
            # less than copying the logits [rows, head words + clusters]; one matmul against the joined weights.
            return F.linear(hidden, torch.cat([weight, self.cluster_weight]), torch.cat([bias, self.cluster_bias]))
        # Few rows (decoding): two matmuls and a small concatenation of logits, no copy of the head's weights.
        return torch.cat(
            [F.linear(hidden, weight, bias), F.linear(hidden, self.cluster_weight, self.cluster_bias)], dim=-1
        )

    @torch.compiler.disable  # host work on data-dependent sizes: never traced into a compiled graph
    def cluster_rows(self, target: torch.Tensor, device: torch.device | None = None) -> ClusterRows:
        """Which positions of ``target`` [N] fall in each tail cluster, for `forward`.

        The row counts must be known on the host. Computed from targets on the host (the trainer does this for
        each batch before copying it) this costs no device synchronisation; the row indices then travel to ``device``
        in one asynchronous copy. From targets on an accelerator it waits once for the counts."""
        cluster = torch.bucketize(target, self._cutoffs_on(target.device), right=True)  # 0 = head, i = tail i
        counts = torch.bincount(cluster, minlength=self.n_clusters + 1).tolist()
        order = torch.argsort(cluster, stable=True)
        if device is not None and torch.device(device) != order.device:
            if torch.device(device).type == "cuda" and order.device.type == "cpu":
                order = order.pin_memory()
            order = order.to(device, non_blocking=True)
        return ClusterRows(rows=list(order.split(counts))[1:])

    def _cutoffs_on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self._cutoffs_host
        return self.cutoff_ends if self.cutoff_ends.device == device else self.cutoff_ends.to(device)

    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor, cluster_rows: ClusterRows | None = None
    ) -> torch.Tensor:
        """hidden [N, d_proj], target [N] -> nll [N] (float32, in the order of the inputs).

        ``cluster_rows`` (`cluster_rows` of these targets) says which rows go to which tail cluster; without it
        they are found here, which on an accelerator waits for the device once. Every tail cluster runs, also on
        zero rows: every parameter then gets a gradient, zeros included, on every rank, which data-parallel
        reduction relies on."""
        weights = self._cluster_weights()
        head_logits = self._cluster_logits(hidden, 0, *weights[0])
        if self.n_clusters == 0:
            return picked_nll(head_logits, target)
        if cluster_rows is None:
            cluster_rows = self.cluster_rows(target)
        # One gather from the head for every row: the target's log-probability for head words, its cluster's
        # for tail words (a single gradient scatter into the head's [N, head] log-probabilities).
        cluster_column = self.shortlist_size - 1 + torch.bucketize(target, self._cutoffs_on(target.device), right=True)
        head_column = torch.where(target < self.shortlist_size, target, cluster_column)
        nll = picked_nll(head_logits, head_column)
        pad = _pads_rows(hidden)
        for i in range(1, self.n_clusters + 1):
            rows = cluster_rows.rows[i - 1]
            selected = _padded(rows) if pad else rows
            local = target.index_select(0, selected) - self.bounds[i][0]
            tail_nll = picked_nll(self._cluster_logits(hidden.index_select(0, selected), i, *weights[i]), local)
            if pad:
                tail_nll = tail_nll[: rows.shape[0]]  # the padding rows get no gradient
            nll = nll.index_add(0, rows, tail_nll)
        return nll

    @torch.no_grad()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_proj] -> the most probable word of each row [N], exactly ``log_prob(hidden).argmax(-1)``
        (the lowest id among equals), computing a tail cluster only where it can hold the winner.

        A tail word's log-probability is its cluster's log-probability in the head plus its own within the
        cluster, which is at most 0; so a cluster whose head log-probability is below the best word found so far
        cannot win and its logits are never computed. Greedy decoding mostly emits head words, and the tail
        clusters hold most of the vocabulary's weights: for a 10k-word model that saves most of the output
        layer. Which clusters are needed is read on the host once (one synchronisation); a needed cluster is
        computed for every row, as `log_prob` computes it, so that the values are the same to the last bit."""
        head_logprob = F.log_softmax(self._cluster_logits(hidden, 0, *self._cluster_weight(0)).float(), dim=-1)
        if self.n_clusters == 0:
            return head_logprob.argmax(dim=-1)
        best_value, best = head_logprob[:, : self.shortlist_size].max(dim=-1)
        may_win = head_logprob[:, self.shortlist_size :] >= best_value.unsqueeze(1)  # [N, clusters]
        for i, needed in enumerate(may_win.any(dim=0).tolist(), start=1):
            if not needed:
                continue
            # Every row, as `log_prob` computes it: a matmul over a subset of rows may round differently.
            tail_logprob = F.log_softmax(self._cluster_logits(hidden, i, *self._cluster_weight(i)).float(), dim=-1)
            cluster_logprob = head_logprob[:, self.shortlist_size + i - 1 : self.shortlist_size + i]
            value, local = (cluster_logprob + tail_logprob).max(dim=-1)
            wins = may_win[:, i - 1] & (value > best_value)  # strictly: on a tie the lower id (earlier) stays
            best_value = torch.where(wins, value, best_value)
            best = torch.where(wins, local + self.bounds[i][0], best)
        return best

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_proj] -> log-probabilities over the whole vocabulary [N, n_token] (float32)."""
        weights = self._cluster_weights()
        head_logprob = F.log_softmax(self._cluster_logits(hidden, 0, *weights[0]).float(), dim=-1)
        if self.n_clusters == 0:
            return head_logprob
        parts = [head_logprob[:, : self.shortlist_size]]
        for i in range(1, self.n_clusters + 1):
            tail_logprob = F.log_softmax(self._cluster_logits(hidden, i, *weights[i]).float(), dim=-1)
            parts.append(head_logprob[:, self.shortlist_size + i - 1 : self.shortlist_size + i] + tail_logprob)
        return torch.cat(parts, dim=1)
