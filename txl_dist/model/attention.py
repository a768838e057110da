"""Relative multi-head attention of Transformer-XL (Dai et al., 2019, section 3.3).

For a query at absolute position i and a key at position j (keys are [memory ; current segment]):

    score(i, j) = (q_i + u)^T k_j  +  (q_i + v)^T W_R R_{i-j}
                = (a) q_i^T k_j + (b) q_i^T W_R R_{i-j} + (c) u^T k_j + (d) v^T W_R R_{i-j}

with q = W_q E x, k = W_{k,E} E x, u = ``r_w_bias``, v = ``r_r_bias`` and R the sinusoid encoding of the
relative distance. The (b)+(d) term is computed for every (query, distance) pair and moved onto (query, key)
positions by the relative shift. Two implementations share the projections and the position term:

- ``reference``: (a)+(c) by one batched matmul that adds the shifted (b)+(d), mask, softmax, dropout, matmul;
- ``fused``: ``torch.nn.functional.scaled_dot_product_attention`` on (q + u, k, v) with the masked position term
  as an additive bias (a memory-efficient or cuDNN kernel on GPUs).

Precision: the matmuls run in the compute dtype (the dtype of the projections: bf16/fp16 under autocast or with
half weights, float32 or float64 otherwise), so tensor cores and the fused kernels apply; the softmax and its
normalisation are float32 at least. The 1/sqrt(d_head) scale is applied to q + u and q + v before the matmuls
(never to the larger score tensor), which also keeps fp16 scores far from overflow. Masked positions get a large
finite value, so no row turns into NaN; a query that may attend to nothing gets a zero vector.

Only the current segment is projected to queries; keys and values cover [memory ; segment]. The steps are
separate methods (`project`, `attend`, `residual`) so that incremental decoding
(`txl_dist.model.decoding.KVCache`) can take the memory's keys and values from a cache instead of
projecting the memory again.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from txl_dist.model.dropout import Dropout

# Large enough to remove a key from the softmax (exp underflows to 0), small enough that adding the position
# term can never overflow float32 or bfloat16 to -inf (a row of -inf would give NaN). float16 uses its own
# minimum (see `mask_value`).
MASK_VALUE = -1e30


def mask_value(dtype: torch.dtype) -> float:
    """The fill for masked scores in ``dtype``: MASK_VALUE, or the most negative finite value where that is
    smaller (float16)."""
    return max(MASK_VALUE, torch.finfo(dtype).min)


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


@functools.lru_cache(maxsize=16)
def cached_attention_mask(qlen: int, mlen: int, mem_len: int, same_length: bool, device: torch.device) -> torch.Tensor:
    """`attention_mask`, built once per shape and device (the model asks for the same few every segment)."""
    return attention_mask(qlen, mlen, mem_len, same_length, device)


def may_mask_whole_rows(mem_len: int, same_length: bool) -> bool:
    """Whether `attention_mask` can leave a query with no key at all: only ``same_length`` with ``mem_len=0``
    (every other query at least sees itself)."""
    return same_length and mem_len == 0


def rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Move x[..., i, m], indexed by distance klen-1-m, to x[..., i, j] indexed by key j.

    For a query i of a segment of qlen queries, key j lies at distance (klen - qlen + i) - j, which is entry
    m = qlen - 1 - i + j. Padding one zero column on the left and reading the padded rows with a stride of one
    less does that shift for all rows at once. Entries for keys after the query (j > klen - qlen + i) receive
    unrelated values; the causal mask removes them.
    """
    return rel_shift_padded(F.pad(x, (1, 0)))


def rel_shift_padded(padded: torch.Tensor) -> torch.Tensor:
    """`rel_shift` of x from ``padded`` = x with its zero column already in front, [..., qlen, klen + 1], whose
    last two dimensions are contiguous: a view, no copy. The attention computes (b)+(d) against a position
    projection that has a zero row in front, which gives that padded layout straight from the matmul."""
    *lead, qlen, klen_plus_one = padded.shape
    return padded.flatten(-2)[..., qlen:].view(*lead, qlen, klen_plus_one - 1)


class RelShift(torch.autograd.Function):
    """`rel_shift_padded` with a backward pass that writes the padded gradient once (the gradient after qlen
    zeros), where the view's own backward would zero-fill the whole padded tensor and then copy into it."""

    @staticmethod
    def forward(ctx, padded: torch.Tensor) -> torch.Tensor:
        return rel_shift_padded(padded)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        *lead, qlen, klen = grad.shape
        flat = torch.cat([grad.new_zeros(*lead, qlen), grad.reshape(*lead, qlen * klen)], dim=-1)
        return flat.view(*lead, qlen, klen + 1)


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """Attention sub-layer with its residual connection and layer norm (post-LN, or pre-LN if configured)."""

    def __init__(
        self,
        n_head: int,
        d_model: int,
        d_head: int,
        dropout: float,
        dropatt: float,
        pre_lnorm: bool,
        layer_norm_eps: float,
        attn_impl: str,
        own_position_biases: bool,
    ):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.scale = 1.0 / math.sqrt(d_head)
        self.pre_lnorm = pre_lnorm
        self.attn_impl = attn_impl
        self.dropatt_p = dropatt
        # One matrix for q, k and v (the authors' layout, so checkpoints convert by name); rows [0, H*D) give q.
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.drop = Dropout(dropout)
        self.dropatt = Dropout(dropatt)
        if own_position_biases:  # untie_r: u and v of this layer only
            self.r_w_bias = nn.Parameter(torch.empty(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.empty(n_head, d_head))
        else:
            self.r_w_bias = self.r_r_bias = None

    # ---- projections -------------------------------------------------------------------------------------------

    def _split_heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """x [len, B, parts*H*D] -> ``parts`` views [H, B, len, D]."""
        length, bsz = x.shape[0], x.shape[1]
        return x.view(length, bsz, parts, self.n_head, self.d_head).permute(2, 3, 1, 0, 4).unbind(0)

    def project(self, w: torch.Tensor, mem: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w [qlen, B, d_model], mem [mlen, B, d_model] or None -> q [H, B, qlen, D] (a view), and k, v
        [H, B, mlen + qlen, D] (contiguous). Queries come from the segment only; the memory is projected to keys
        and values by its own matmul, whose input needs no gradient (the memory is detached), so the backward
        pass computes none for it either. Layer-normed first with pre-LN."""
        hd = self.n_head * self.d_head
        q, k, v = self._split_heads(F.linear(self.layer_norm(w) if self.pre_lnorm else w, self.qkv_net.weight), 3)
        if mem is None or mem.shape[0] == 0:
            return q, k.contiguous(), v.contiguous()
        mem = mem.to(w.dtype)
        k_mem, v_mem = self._split_heads(
            F.linear(self.layer_norm(mem) if self.pre_lnorm else mem, self.qkv_net.weight[hd:]), 2
        )
        # One pass each: the concatenation writes the [H, B, klen, D] layout the attention matmuls want.
        return q, torch.cat([k_mem, k], dim=2), torch.cat([v_mem, v], dim=2)

    def project_positions(self, r: torch.Tensor) -> torch.Tensor:
        """r [klen, d_model] (distances klen-1 .. 0) -> [klen + 1, H, D] with a zero row in front (see
        `rel_shift_padded`); r_net has no bias, so the zero row could also come from a zero encoding."""
        return F.pad(self.r_net(r), (0, 0, 1, 0)).view(r.shape[0] + 1, self.n_head, self.d_head)

    # ---- forward -----------------------------------------------------------------------------------------------

    def forward(
        self,
        w: torch.Tensor,
        r: torch.Tensor,
        mask: torch.Tensor,
        mem: torch.Tensor | None,
        r_w_bias: torch.Tensor | None = None,
        r_r_bias: torch.Tensor | None = None,
        *,
        may_mask_rows: bool = True,
    ) -> torch.Tensor:
        """w [qlen, B, d_model], r [klen, d_model], mask [qlen, klen] bool, mem [mlen, B, d_model]
        -> [qlen, B, d_model].

        The position biases come from the layer itself (untie_r) or from the caller (shared by all layers).
        ``may_mask_rows=False`` promises that every query may attend to some key (see `may_mask_whole_rows`),
        which saves zeroing the rows that may not.
        """
        q, k, val = self.project(w, mem)
        attn_vec = self.attend(q, k, val, self.project_positions(r), r_w_bias, r_r_bias, mask, may_mask_rows)
        return self.residual(w, attn_vec)

    def residual(self, w: torch.Tensor, attn_vec: torch.Tensor) -> torch.Tensor:
        """attn_vec [qlen, B, H*D] -> the sub-layer's output: output projection, dropout, residual, layer norm."""
        attn_out = self.drop(self.o_net(attn_vec))
        return w + attn_out if self.pre_lnorm else self.layer_norm(w + attn_out)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        val: torch.Tensor,
        r_head: torch.Tensor,
        r_w_bias: torch.Tensor | None,
        r_r_bias: torch.Tensor | None,
        mask: torch.Tensor | None,
        may_mask_rows: bool = True,
    ) -> torch.Tensor:
        """q [H, B, qlen, D], k and val [H, B, klen, D] (any layout in which heads and batch merge),
        r_head [klen + 1, H, D] (zero row first), mask [qlen, klen] or None when no key is masked
        -> attention vectors [qlen, B, H*D] in the compute dtype (that of q).

        Heads are the outer dimension: the attention matmuls run on contiguous [H*B, len, D] tensors (batched
        matmuls on strided views of time-major tensors are much slower) and the position term needs no transposition."""
        u = self.r_w_bias if self.r_w_bias is not None else r_w_bias
        v = self.r_r_bias if self.r_r_bias is not None else r_r_bias
        n_head, bsz, qlen, d_head = q.shape
        klen = k.shape[2]
        dtype = q.dtype
        # q + u and q + v in one operation, scaled once here, on the smallest tensors: [2, H, B, qlen, D].
        biases = torch.stack([u, v]).to(dtype).view(2, n_head, 1, 1, d_head)
        q_u, q_v = torch.add(q.unsqueeze(0), biases).mul_(self.scale).unbind(0)  # unbind: one-pass backward
        q_u = q_u.reshape(n_head * bsz, qlen, d_head)
        q_v = q_v.reshape(n_head, bsz * qlen, d_head)
        k_b = k.reshape(n_head * bsz, klen, d_head)  # views (also of a cache's buffer: heads and batch merge)
        v_b = val.reshape(n_head * bsz, klen, d_head)
        # (b) + (d) by distance, per head over all (batch, query) rows: [H, B*qlen, klen + 1]; then shifted onto
        # keys: [H*B, qlen, klen], a view.
        by_distance = torch.bmm(q_v, r_head.to(dtype).permute(1, 2, 0))
        padded = by_distance.view(n_head * bsz, qlen, klen + 1)
        position = RelShift.apply(padded) if torch.is_grad_enabled() else rel_shift_padded(padded)
        # Masked keys get a large negative additive bias: unlike masked_fill, its backward pass costs nothing
        # (the softmax already gives those positions zero gradient).
        mask_bias = None
        if mask is not None:
            mask_bias = (
                torch.zeros((), dtype=dtype, device=q.device).expand(qlen, klen).masked_fill(mask, mask_value(dtype))
            )
        out = self._weigh_values(q_u, k_b, v_b, position, mask_bias, n_head)
        # [H*B, qlen, D] -> [qlen, B, H*D]
        attn_vec = out.view(n_head, bsz, qlen, d_head).permute(2, 1, 0, 3)
        if may_mask_rows and mask is not None:
            # A query that may attend to no key at all gets a zero vector instead of an average of masked values.
            attn_vec = attn_vec * (~mask.all(dim=-1)).to(dtype)[:, None, None, None]
        return attn_vec.reshape(qlen, bsz, n_head * d_head)

    def _weigh_values(
        self,
        q_u: torch.Tensor,
        k_b: torch.Tensor,
        v_b: torch.Tensor,
        position: torch.Tensor,
        mask_bias: torch.Tensor | None,
        n_head: int,
    ) -> torch.Tensor:
        """(q + u) k^T plus the shifted position term and the mask bias, softmax, attention dropout, times the
        values: q_u [H*B, qlen, D], k_b and v_b [H*B, klen, D], position [H*B, qlen, klen] -> [H*B, qlen, D]."""
        impl = self.attn_impl
        if impl == "auto":
            impl = "fused" if q_u.is_cuda else "reference"
        if impl == "fused":
            (heads_batch, qlen, d_head), klen = q_u.shape, k_b.shape[1]
            bsz = heads_batch // n_head
            bias = position if mask_bias is None else position + mask_bias
            return F.scaled_dot_product_attention(
                q_u.view(n_head, bsz, qlen, d_head),
                k_b.view(n_head, bsz, klen, d_head),
                v_b.view(n_head, bsz, klen, d_head),
                attn_mask=bias.view(n_head, bsz, qlen, klen),
                dropout_p=self.dropatt_p if self.training else 0.0,
                scale=1.0,
            ).view(heads_batch, qlen, d_head)
        scores = torch.baddbmm(position, q_u, k_b.transpose(1, 2))  # (a)+(c) + (b)+(d): [H*B, qlen, klen]
        if mask_bias is not None:
            scores = scores.add_(mask_bias)
        prob = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        return torch.bmm(self.dropatt(prob).to(q_u.dtype), v_b)
