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

import torch
import torch.nn.functional as F
from torch import nn


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

    def _cluster_logits(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """Logits of cluster i's words (for i == 0: head words, then one logit per tail cluster)."""
        if self.div_val == 1:
            start, end = self.bounds[i]
            weight = self.out_layers[0].weight[start:end]
            bias = self.out_layers[0].bias[start:end]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        if i == 0 and self.n_clusters > 0:
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
        proj = self.out_projs[i]
        if proj is not None:
            hidden = F.linear(hidden, proj.t())
        return F.linear(hidden, weight, bias)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_proj], target [N] -> nll [N] (float32, in the order of the inputs)."""
        head_logprob = F.log_softmax(self._cluster_logits(hidden, 0).float(), dim=-1)
        if self.n_clusters == 0:
            return -head_logprob.gather(1, target.unsqueeze(1)).squeeze(1)
        in_head = target < self.shortlist_size
        head_target = torch.where(in_head, target, torch.zeros_like(target))
        nll = -head_logprob.gather(1, head_target.unsqueeze(1)).squeeze(1)
        for i in range(1, self.n_clusters + 1):
            start, end = self.bounds[i]
            # A cluster with no target in this batch still runs (on zero rows): every parameter then gets a
            # gradient, zeros included, on every rank, which data-parallel gradient reduction relies on.
            rows = ((target >= start) & (target < end)).nonzero().squeeze(1)
            tail_logprob = F.log_softmax(self._cluster_logits(hidden.index_select(0, rows), i).float(), dim=-1)
            local = (target.index_select(0, rows) - start).unsqueeze(1)
            logprob = head_logprob[rows, self.shortlist_size + i - 1] + tail_logprob.gather(1, local).squeeze(1)
            nll = nll.index_copy(0, rows, -logprob)
        return nll

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, d_proj] -> log-probabilities over the whole vocabulary [N, n_token] (float32)."""
        head_logprob = F.log_softmax(self._cluster_logits(hidden, 0).float(), dim=-1)
        if self.n_clusters == 0:
            return head_logprob
        parts = [head_logprob[:, : self.shortlist_size]]
        for i in range(1, self.n_clusters + 1):
            tail_logprob = F.log_softmax(self._cluster_logits(hidden, i).float(), dim=-1)
            parts.append(head_logprob[:, self.shortlist_size + i - 1 : self.shortlist_size + i] + tail_logprob)
        return torch.cat(parts, dim=1)
