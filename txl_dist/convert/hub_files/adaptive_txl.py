"""The adaptive input embedding and the projected adaptive log-softmax of Transformer-XL (clusters at cutoffs).

Part of the remote code that `launchers/convert.py export-to-hub` writes beside modeling_txl.py (which see);
it imports torch and the configuration beside it only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_txl import TransformerXLConfig


def _cluster_bounds(config: TransformerXLConfig) -> list[tuple[int, int]]:
    ends = [0] + list(config.cutoffs) + [config.n_token]
    return list(zip(ends[:-1], ends[1:]))


class Projection(nn.Module):
    """A [d_proj, d_cluster] matrix (a module, so that its parameter is named ``...weight``)."""

    def __init__(self, d_proj: int, d_cluster: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_proj, d_cluster))


class AdaptiveEmbedding(nn.Module):
    """Token ids -> embeddings [..., d_model] scaled by sqrt(d_model); cluster i has width d_embed // div_val**i."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        c = config
        self.div_val, self.scale = c.div_val, c.d_model**0.5
        self.bounds = _cluster_bounds(c)
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ModuleDict()
        if c.div_val == 1:
            self.emb_layers.append(nn.Embedding(c.n_token, c.d_embed))
            if c.d_model != c.d_embed:
                self.emb_projs["0"] = Projection(c.d_model, c.d_embed)
        else:
            for i, (start, end) in enumerate(self.bounds):
                width = c.d_embed // c.div_val**i
                self.emb_layers.append(nn.Embedding(end - start, width))
                self.emb_projs[str(i)] = Projection(c.d_model, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.div_val == 1:
            embed = self.emb_layers[0](ids)
            if "0" in self.emb_projs:
                embed = F.linear(embed, self.emb_projs["0"].weight)
            return embed * self.scale
        embed = None
        for i, (start, end) in enumerate(self.bounds):
            # Every cluster embeds every token at a clamped index; a token keeps its own cluster's vector.
            inside = (ids >= start) & (ids < end)
            part = F.linear(self.emb_layers[i]((ids - start).clamp(0, end - start - 1)), self.emb_projs[str(i)].weight)
            part = part * inside.unsqueeze(-1).to(part.dtype)
            embed = part if embed is None else embed + part
        return embed * self.scale


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """Hidden states [N, d_model] -> log-probabilities [N, n_token], or the negative log-likelihood of targets.

    The head scores the words before cutoffs[0] and one logit per tail cluster; a tail word's log-probability is
    its cluster's head log-probability plus its log-probability within the cluster. Tail cluster i (from 1) is
    logit ``cluster_weight[i - 1]`` of the head. The softmax and all that follows are float32.
    """

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        c = config
        self.div_val = c.div_val
        self.bounds = _cluster_bounds(c)
        self.shortlist = self.bounds[0][1]
        self.n_clusters = len(c.cutoffs)
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, c.d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ModuleDict()
        if c.div_val == 1:
            self.out_layers.append(nn.Linear(c.d_embed, c.n_token))
            if c.d_model != c.d_embed:
                for i in range(len(self.bounds)):
                    self.out_projs[str(i)] = Projection(c.d_model, c.d_embed)
        else:
            for i, (start, end) in enumerate(self.bounds):
                width = c.d_embed // c.div_val**i
                self.out_layers.append(nn.Linear(width, end - start))
                self.out_projs[str(i)] = Projection(c.d_model, width)

    def _cluster_logits(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """Logits of cluster i's words; for the head, followed by one logit per tail cluster."""
        if self.div_val == 1:
            start, end = self.bounds[i]
            weight, bias = self.out_layers[0].weight[start:end], self.out_layers[0].bias[start:end]
        else:
            weight, bias = self.out_layers[i].weight, self.out_layers[i].bias
        if i == 0 and self.n_clusters:
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
        if str(i) in self.out_projs:
            hidden = F.linear(hidden, self.out_projs[str(i)].weight.t())
        return F.linear(hidden, weight, bias)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, d_model] -> [N, n_token] (float32)."""
        head = F.log_softmax(self._cluster_logits(hidden, 0).float(), dim=-1)
        if not self.n_clusters:
            return head
        parts = [head[:, : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            tail = F.log_softmax(self._cluster_logits(hidden, i).float(), dim=-1)
            parts.append(head[:, self.shortlist + i - 1 : self.shortlist + i] + tail)
        return torch.cat(parts, dim=1)

    def nll(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[N, d_model], [N] -> negative log-likelihood [N] (float32), without the [N, n_token] matrix."""
        head = F.log_softmax(self._cluster_logits(hidden, 0).float(), dim=-1)
        in_head = target < self.shortlist
        nll = -head.gather(1, torch.where(in_head, target, 0).unsqueeze(1)).squeeze(1)
        for i in range(1, self.n_clusters + 1):
            start, end = self.bounds[i]
            rows = ((target >= start) & (target < end)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            tail = F.log_softmax(self._cluster_logits(hidden.index_select(0, rows), i).float(), dim=-1)
            local = (target.index_select(0, rows) - start).unsqueeze(1)
            logprob = head[rows, self.shortlist + i - 1] + tail.gather(1, local).squeeze(1)
            nll = nll.index_copy(0, rows, -logprob)
        return nll
