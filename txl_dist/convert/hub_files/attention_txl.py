"""The decoder layer of Transformer-XL: relative multi-head attention (section 3.3 of the paper), feed-forward net.

Part of the remote code that `launchers/convert.py export-to-hub` writes beside modeling_txl.py (which see);
it imports torch and the configuration beside it only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_txl import TransformerXLConfig

# Removes a key from the softmax (exp underflows to 0) without ever overflowing float32 to -inf, so a row never
# turns into NaN.
MASK_VALUE = -1e30


def sinusoid_encoding(distances: torch.Tensor, d_model: int) -> torch.Tensor:
    """R for relative distances [n] -> [n, d_model] (float32): sines then cosines."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, device=distances.device, dtype=torch.float32) / d_model))
    angles = torch.outer(distances.float(), inv_freq)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """[..., q, k] scores indexed by distance (k-1, ..., 0) -> indexed by key position.

    The q queries are the last q of the k keys; for query i, key j lies at distance (k - q + i) - j, entry
    q - 1 - i + j. One zero column on the left and reading the padded rows with a stride one shorter moves every
    row at once; entries of keys after the query get unrelated values, which the causal mask removes.
    """
    *lead, q, k = x.shape
    padded = F.pad(x, (1, 0)).view(*lead, k + 1, q)
    return padded[..., 1:, :].reshape(*lead, q, k)


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """The attention sub-layer with its residual connection and layer norm (post-LN, or pre-LN)."""

    def __init__(self, config: TransformerXLConfig, own_position_biases: bool):
        super().__init__()
        c = config
        self.n_head, self.d_head, self.pre_lnorm = c.n_head, c.d_head, c.pre_lnorm
        self.scale = 1.0 / math.sqrt(c.d_head)
        self.qkv_net = nn.Linear(c.d_model, 3 * c.n_head * c.d_head, bias=False)
        self.r_net = nn.Linear(c.d_model, c.n_head * c.d_head, bias=False)
        self.o_net = nn.Linear(c.n_head * c.d_head, c.d_model, bias=False)
        self.layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)
        self.drop = nn.Dropout(c.dropout)
        self.dropatt = nn.Dropout(c.dropatt)
        if own_position_biases:  # untie_r
            self.r_w_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))
        else:
            self.r_w_bias = self.r_r_bias = None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Layer input [B, n, d_model] -> queries, keys, values [3, B, n, H, D]."""
        heads = self.qkv_net(self.layer_norm(x) if self.pre_lnorm else x)
        return heads.view(*x.shape[:2], 3, self.n_head, self.d_head).permute(2, 0, 1, 3, 4)

    def forward(self, x, pos_emb, visible, mem_keys, mem_values, u, v):
        """x [B, q, d_model]; pos_emb [k, d_model] for distances k-1..0; visible [B, q, k] bool over
        [memory ; x]; mem_keys/values [B, m, H, D] (k = m + q) -> (output [B, q, d_model], keys, values of x)."""
        u = self.r_w_bias if self.r_w_bias is not None else u
        v = self.r_r_bias if self.r_r_bias is not None else v
        batch, qlen = x.shape[:2]
        query, key, value = self.project(x)
        all_keys = torch.cat([mem_keys.to(key.dtype), key], dim=1)
        all_values = torch.cat([mem_values.to(value.dtype), value], dim=1)
        klen = all_keys.shape[1]
        r_head_k = self.r_net(pos_emb).view(klen, self.n_head, self.d_head)
        # Logits, softmax and the weighted sum in float32 (at least) whatever the weights' dtype.
        dtype = torch.promote_types(query.dtype, torch.float32)
        qf, kf, vf, rf = (t.to(dtype) for t in (query, all_keys, all_values, r_head_k))
        content = torch.einsum("bqhd,bkhd->bhqk", qf + u.to(dtype), kf)  # (a) + (c)
        position = rel_shift(torch.einsum("bqhd,khd->bhqk", qf + v.to(dtype), rf))  # (b) + (d)
        scores = ((content + position) * self.scale).masked_fill(~visible[:, None], MASK_VALUE)
        prob = self.dropatt(torch.softmax(scores, dim=-1))
        attn = torch.einsum("bhqk,bkhd->bqhd", prob, vf)
        # A query that may attend to nothing (padding) gets zeros, not an average of masked values.
        attn = attn * visible.any(dim=-1)[:, :, None, None].to(attn.dtype)
        out = self.drop(self.o_net(attn.to(x.dtype).reshape(batch, qlen, self.n_head * self.d_head)))
        out = x + out if self.pre_lnorm else self.layer_norm(x + out)
        return out, key, value


class PositionwiseFF(nn.Module):
    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.pre_lnorm = config.pre_lnorm
        # Indices 0 and 3 are the two linear maps, as in the authors' code.
        self.CoreNet = nn.Sequential(
            nn.Linear(config.d_model, config.d_inner),
            nn.ReLU(inplace=True),
            nn.Dropout(config.dropout),
            nn.Linear(config.d_inner, config.d_model),
            nn.Dropout(config.dropout),
        )
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_lnorm:
            return x + self.CoreNet(self.layer_norm(x))
        return self.layer_norm(x + self.CoreNet(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(config, own_position_biases=config.untie_r)
        self.pos_ff = PositionwiseFF(config)

    def forward(self, x, pos_emb, visible, mem_keys, mem_values, u, v):
        out, key, value = self.dec_attn(x, pos_emb, visible, mem_keys, mem_values, u, v)
        return self.pos_ff(out), key, value
