"""Relative multi-head attention of Transformer-XL (Dai et al., 2019, section 3.3).

For a query at absolute position i and a key at position j (keys are [memory ; current segment]):

    score(i, j) = (q_i + u)^T k_j  +  (q_i + v)^T W_R R_{i-j}
                = (a) q_i^T k_j + (b) q_i^T W_R R_{i-j} + (c) u^T k_j + (d) v^T W_R R_{i-j}

with q = W_q E x, k = W_{k,E} E x, u = ``r_w_bias``, v = ``r_r_bias`` and R the sinusoid encoding of the
relative distance. The (b)+(d) term is computed for every (query, distance) pair and moved onto (query, key)
positions by the relative shift. Two implementations share the projections:

- ``reference``: explicit matmuls, mask, softmax, dropout;
- ``fused``: ``torch.nn.functional.scaled_dot_product_attention`` on (q + u, k, v) with the scaled, masked
  position term passed as an additive bias.

Both compute the logits, the softmax and the weighted sum in float32, whatever the dtype of the weights or an
enclosing autocast, and mask with a large finite value so that no row turns into NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# Large enough to remove a key from the softmax (exp underflows to 0), small enough that adding the position
# term can never overflow float32 to -inf (a row of -inf would give NaN).
MASK_VALUE = -1e30


def sinusoid_encoding(positions: torch.Tensor, d_model: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """R for the given relative distances: [len(positions), d_model], sines then cosines."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, device=positions.device, dtype=dtype) / d_model))
    angles = torch.outer(positions.to(dtype), inv_freq)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def relative_positions(klen: int, clamp_len: int, device: torch.device) -> torch.Tensor:
    """Distances klen-1, ..., 1, 0 (the order the relative shift expects), clamped at clamp_len when > 0."""
    positions = torch.arange(klen - 1, -1, -1, device=device, dtype=torch.float32)
    if clamp_len > 0:
        positions = positions.clamp(max=clamp_len)
    return positions


def attention_mask(qlen: int, mlen: int, mem_len: int, same_length: bool, device: torch.device) -> torch.Tensor:
    """[qlen, mlen + qlen] bool, True where query i may NOT attend to key j.

    Query i sits at absolute position mlen + i. It sees keys up to itself; with ``same_length`` only the
    mem_len most recent of them (itself included), so every query sees the same number of keys once the memory
    is full, as in the paper's evaluation.
    """
    klen = mlen + qlen
    query_pos = torch.arange(qlen, device=device)[:, None] + mlen
    key_pos = torch.arange(klen, device=device)[None, :]
    distance = query_pos - key_pos
    masked = distance < 0
    if same_length:
        masked = masked | (distance >= mem_len)
    return masked


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Move x[..., i, m], indexed by distance klen-1-m, to x[..., i, j] indexed by key j.

    For a query i of a segment of qlen queries, key j lies at distance (klen - qlen + i) - j, which is entry
    m = qlen - 1 - i + j. Padding one zero column on the left and reading the padded rows with a stride of one
    less does that shift for all rows at once. Entries for keys after the query (j > klen - qlen + i) receive
    unrelated values; the causal mask removes them.
    """
    *lead, qlen, klen = x.shape
    padded = F.pad(x, (1, 0))
    padded = padded.view(*lead, klen + 1, qlen)
    return padded[..., 1:, :].reshape(*lead, qlen, klen)


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """Attention sub-layer with its residual connection and layer norm (post-LN, or pre-LN if configured)."""

    def __init__(self, n_head: int, d_model: int, d_head: int, dropout: float, dropatt: float,
                 pre_lnorm: bool, layer_norm_eps: float, attn_impl: str, own_position_biases: bool):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.scale = 1.0 / math.sqrt(d_head)
        self.pre_lnorm = pre_lnorm
        self.attn_impl = attn_impl
        self.dropatt_p = dropatt
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.drop = nn.Dropout(dropout)
        self.dropatt = nn.Dropout(dropatt)
        if own_position_biases:  # untie_r: u and v of this layer only
            self.r_w_bias = nn.Parameter(torch.empty(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.empty(n_head, d_head))
        else:
            self.r_w_bias = self.r_r_bias = None

    def forward(self, w: torch.Tensor, r: torch.Tensor, mask: torch.Tensor, mem: torch.Tensor | None,
                r_w_bias: torch.Tensor | None = None, r_r_bias: torch.Tensor | None = None) -> torch.Tensor:
        """w [qlen, B, d_model], r [klen, d_model], mask [qlen, klen] bool, mem [mlen, B, d_model] -> [qlen, B, d_model].

        The position biases come from the layer itself (untie_r) or from the caller (shared by all layers).
        """
        u = self.r_w_bias if self.r_w_bias is not None else r_w_bias
        v = self.r_r_bias if self.r_r_bias is not None else r_r_bias
        qlen, bsz = w.shape[0], w.shape[1]
        cat = w if mem is None or mem.shape[0] == 0 else torch.cat([mem.to(w.dtype), w], dim=0)
        heads = self.qkv_net(self.layer_norm(cat) if self.pre_lnorm else cat)
        r_head_k = self.r_net(r)
        klen = heads.shape[0]
        q, k, val = heads.chunk(3, dim=-1)
        q = q[-qlen:].reshape(qlen, bsz, self.n_head, self.d_head)
        k = k.reshape(klen, bsz, self.n_head, self.d_head)
        val = val.reshape(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.reshape(klen, self.n_head, self.d_head)

        # float32 at least (float64 stays float64), outside any autocast region.
        dtype = torch.promote_types(heads.dtype, torch.float32)
        with torch.autocast(device_type=w.device.type, enabled=False):
            attn_vec = self._attend(*(t.to(dtype) for t in (q, k, val, r_head_k, u, v)), mask)
        # A query that may attend to no key at all gets a zero vector instead of an average of masked values.
        attn_vec = attn_vec * (~mask.all(dim=-1)).to(attn_vec.dtype)[:, None, None, None]
        attn_vec = attn_vec.to(heads.dtype).reshape(qlen, bsz, self.n_head * self.d_head)
        attn_out = self.drop(self.o_net(attn_vec))
        return w + attn_out if self.pre_lnorm else self.layer_norm(w + attn_out)

    def _position_term(self, q: torch.Tensor, r_head_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(b) + (d) on (query, key) positions: [B, H, qlen, klen]."""
        qv = (q + v).permute(1, 2, 0, 3)  # [B, H, qlen, D]
        bd = torch.matmul(qv, r_head_k.permute(1, 2, 0))  # [B, H, qlen, klen] by distance
        return rel_shift(bd)

    def _attend(self, q, k, val, r_head_k, u, v, mask) -> torch.Tensor:
        """[qlen, B, H, D] inputs (float32 or float64) -> attention vectors [qlen, B, H, D]."""
        impl = self.attn_impl
        if impl == "auto":
            impl = "fused" if q.is_cuda else "reference"
        bd = self._position_term(q, r_head_k, v)
        qu = (q + u).permute(1, 2, 0, 3)  # [B, H, qlen, D]
        k_b, v_b = k.permute(1, 2, 0, 3), val.permute(1, 2, 0, 3)
        if impl == "fused":
            bias = (bd * self.scale).masked_fill(mask, MASK_VALUE)
            out = F.scaled_dot_product_attention(
                qu, k_b, v_b, attn_mask=bias, dropout_p=self.dropatt_p if self.training else 0.0, scale=self.scale
            )
        else:
            ac = torch.matmul(qu, k_b.transpose(-1, -2))  # (a) + (c): [B, H, qlen, klen]
            scores = ((ac + bd) * self.scale).masked_fill(mask, MASK_VALUE)
            prob = self.dropatt(torch.softmax(scores, dim=-1))
            out = torch.matmul(prob, v_b)
        return out.permute(2, 0, 1, 3)
