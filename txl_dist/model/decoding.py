"""Incremental decoding with a key/value cache: `KVCache` runs a model's layers over new tokens, keeping the
keys and values of its memory, so a new token projects only itself and the memory is never projected again.

A segment of several tokens goes through the layers' own `project`, `attend` and `residual`; a single token
(every step of generation) goes through `decode_step`, a handful of tensor operations per layer on weights
gathered once, when the cache is made (`StepWeights`). Both give the hidden states of
`TransformerXLLM.hidden_states` with the memory. Inference only: no dropout, no autograd.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from txl_dist.model.attention import (
    cached_attention_mask,
    may_mask_whole_rows,
    relative_positions,
    sinusoid_encoding,
)
from txl_dist.model.recurrence import MEM_DTYPES, SegmentSettings

if TYPE_CHECKING:
    from txl_dist.model.transformer import DecoderLayer, TransformerXLLM


@dataclasses.dataclass(frozen=True, slots=True)
class StepWeights:
    """The tensors and settings of one decoder layer that `decode_step` needs, gathered once (looking parameters
    up through the modules for every token would cost more than some of the operations)."""

    u: torch.Tensor
    v: torch.Tensor
    pre_lnorm: bool
    n_head: int
    d_head: int
    scale: float
    norm_shape: tuple[int, ...]
    attn_norm: tuple[torch.Tensor, torch.Tensor, float]
    qkv: torch.Tensor
    out: torch.Tensor
    ff_in: torch.Tensor
    ff_in_bias: torch.Tensor
    ff_out: torch.Tensor
    ff_out_bias: torch.Tensor
    ff_norm: tuple[torch.Tensor, torch.Tensor, float]

    @classmethod
    def of(cls, layer: DecoderLayer, shared_u: torch.Tensor | None, shared_v: torch.Tensor | None) -> StepWeights:
        """The weights of ``layer``; its position biases are its own (untie_r) or the shared ones."""
        attn, ff = layer.dec_attn, layer.pos_ff
        own = attn.r_w_bias is not None
        return cls(
            u=attn.r_w_bias if own else shared_u,
            v=attn.r_r_bias if own else shared_v,
            pre_lnorm=attn.pre_lnorm,
            n_head=attn.n_head,
            d_head=attn.d_head,
            scale=attn.scale,
            norm_shape=attn.layer_norm.normalized_shape,
            attn_norm=(attn.layer_norm.weight, attn.layer_norm.bias, attn.layer_norm.eps),
            qkv=attn.qkv_net.weight,
            out=attn.o_net.weight,
            ff_in=ff.CoreNet[0].weight,
            ff_in_bias=ff.CoreNet[0].bias,
            ff_out=ff.CoreNet[3].weight,
            ff_out_bias=ff.CoreNet[3].bias,
            ff_norm=(ff.layer_norm.weight, ff.layer_norm.bias, ff.layer_norm.eps),
        )


def decode_step(
    w: StepWeights,
    x: torch.Tensor,
    buffer: torch.Tensor,
    merged: tuple[torch.Tensor, torch.Tensor],
    at: int,
    first: int,
    columns: torch.Tensor,
    query_bias: torch.Tensor,
) -> torch.Tensor:
    """A decoder layer (``w``: its `StepWeights`) for one new position per sequence: x [B, d_model] -> [B, d_model],
    equal to the layer's `forward` of that position with the memory.

    The new key and value go to ``buffer`` [2, H, B, capacity, D] at index ``at`` (``merged``: its keys and values
    as [H*B, capacity, D] views); the query attends to keys ``first`` .. ``at``. A single query needs no mask and
    no relative shift: ``columns`` [H, D, klen] holds the projected encodings of distances klen-1 .. 0, the
    distances of those keys in order. ``query_bias`` = [u, v] / sqrt(D), [2, H, 1, D]. About fifteen operations
    and no module call: decoding a small model is bound by their dispatch, not by arithmetic."""
    n_head, d_head = w.n_head, w.d_head
    bsz, klen = x.shape[0], at + 1 - first
    qkv = F.linear(torch.layer_norm(x, w.norm_shape, *w.attn_norm) if w.pre_lnorm else x, w.qkv)
    qkv = qkv.view(bsz, 3, n_head, d_head)
    buffer.select(3, at).copy_(qkv[:, 1:].permute(1, 2, 0, 3))
    q_uv = torch.add(query_bias, qkv[:, 0].transpose(0, 1), alpha=w.scale)  # [(q + u), (q + v)] / sqrt(D)
    position = torch.bmm(q_uv[1], columns).view(n_head * bsz, 1, klen)  # (b) + (d)
    scores = torch.baddbmm(
        position, q_uv[0].reshape(n_head * bsz, 1, d_head), merged[0].narrow(1, first, klen).transpose(1, 2)
    )  # + (a) + (c)
    prob = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    attn_vec = torch.bmm(prob.to(x.dtype), merged[1].narrow(1, first, klen))
    out = F.linear(attn_vec.view(n_head, bsz, d_head).transpose(0, 1).reshape(bsz, n_head * d_head), w.out)
    if w.pre_lnorm:
        x = x + out
        inner = torch.layer_norm(x, w.norm_shape, *w.ff_norm)
        return x + F.linear(F.linear(inner, w.ff_in, w.ff_in_bias).relu_(), w.ff_out, w.ff_out_bias)
    x = torch.layer_norm(x + out, w.norm_shape, *w.attn_norm)
    inner = F.linear(F.linear(x, w.ff_in, w.ff_in_bias).relu_(), w.ff_out, w.ff_out_bias)
    return torch.layer_norm(x + inner, w.norm_shape, *w.ff_norm)


class KVCache:
    """A model's decoding state between calls of `hidden_states`: per layer the keys and values of the memory,
    and the position encodings projected by every layer's r_net.

    Keys and values live in one preallocated buffer [2, H, B, capacity, D] per layer (keys at 0, values at 1); a
    call writes the new positions after the memory and attends over a view of [memory ; new], so the memory is
    neither projected nor copied again. When the buffer is full the memory (at most mem_len positions) moves to
    its front, once every capacity - mem_len positions."""

    def __init__(self, model: TransformerXLLM):
        self.model = model
        self.step_weights = [StepWeights.of(layer, model.r_w_bias, model.r_r_bias) for layer in model.layers]
        self._biases = list({id(t): t for w in self.step_weights for t in (w.u, w.v)}.values())
        self.buffers: list[torch.Tensor] = []
        self.merged: list[tuple[torch.Tensor, torch.Tensor]] = []  # per buffer: keys, values as [H*B, capacity, D]
        self.end = 0  # buffer index after the newest position
        self.mlen = 0  # positions of memory before ``end``
        # (clamp_len, dtype, device) -> per layer r_net of the encodings of distances longest-1 .. 0: [longest, H, D]
        # and the same as [H, D, longest] (contiguous, for one-token steps).
        self._position_table: tuple[tuple, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._position_heads: tuple[int, list[torch.Tensor]] | None = None
        self._query_biases: tuple[tuple | None, list[torch.Tensor]] | None = None

    @property
    def batch_size(self) -> int | None:
        return self.buffers[0].shape[2] if self.buffers else None

    @torch.no_grad()
    def hidden_states(self, tokens: torch.Tensor, segment: SegmentSettings | None = None) -> torch.Tensor:
        """tokens [B, L] after everything this cache has seen -> final hidden states [L, B, d_model]; the cache
        is updated in place for the next call. ``segment``: the model's own settings unless given.

        The cache covers exactly the positions the memory would hold (the newest mem_len), so the outputs equal
        those of `TransformerXLLM.hidden_states` with the memory. Dropout is off (call it in eval mode)."""
        model, segment = self.model, segment or self.model.segment
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [batch, length], got shape {list(tokens.shape)}")
        inp = tokens.t()  # [L, B]
        qlen, bsz = inp.shape
        if self.batch_size not in (None, bsz):
            raise ValueError(f"tokens: batch {bsz}, but the cache holds batch {self.batch_size}")
        core_out = model.drop(model.word_emb(inp))
        self._reserve(segment, bsz, qlen, core_out.dtype, inp.device)
        store = MEM_DTYPES[model.config.mem_dtype]
        if (
            qlen == 1
            and not model.training
            and (store is None or store == core_out.dtype)
            and not may_mask_whole_rows(segment.mem_len, segment.same_length)
        ):
            hidden = self._one_token(core_out[0], segment).unsqueeze(0)
        else:
            hidden = model.drop(self._segment(core_out, segment, store))
        self.end += qlen
        self.mlen = min(segment.mem_len, self.mlen + qlen)  # the new positions join the memory
        return hidden

    def _one_token(self, x: torch.Tensor, segment: SegmentSettings) -> torch.Tensor:
        """x [B, d_model], one new token per sequence, through every layer by `decode_step`. The query sees the
        whole memory, or with same_length the newest mem_len - 1 of it (and itself)."""
        first = self.end - (min(self.mlen, segment.mem_len - 1) if segment.same_length else self.mlen)
        columns = self._position_columns(segment, self.end + 1 - first, x.dtype)
        biases = self._query_biases_in(x.dtype)
        for i, weights in enumerate(self.step_weights):
            x = decode_step(weights, x, self.buffers[i], self.merged[i], self.end, first, columns[i], biases[i])
        return x

    def _segment(self, core_out: torch.Tensor, segment: SegmentSettings, store: torch.dtype | None) -> torch.Tensor:
        """core_out [qlen, B, d_model], the embedded new tokens, through every layer by its own modules."""
        model, mlen, qlen = self.model, self.mlen, core_out.shape[0]
        # A single new token sees every key, unless same_length drops the oldest once the memory is full.
        masks_nothing = qlen == 1 and not (segment.same_length and mlen >= segment.mem_len)
        mask = (
            None
            if masks_nothing
            else cached_attention_mask(qlen, mlen, segment.mem_len, segment.same_length, core_out.device)
        )
        may_mask_rows = may_mask_whole_rows(segment.mem_len, segment.same_length)
        r_heads = self._position_heads_for(segment, mlen + qlen, core_out.dtype)
        for i, layer in enumerate(model.layers):
            attn = layer.dec_attn
            q, k_new, v_new = attn.project(core_out, None)
            k, v = self._extend(i, k_new, v_new)
            attn_vec = attn.attend(q, k, v, r_heads[i], model.r_w_bias, model.r_r_bias, mask, may_mask_rows)
            if store is not None and store != core_out.dtype:
                # The memory keeps this layer's input in mem_dtype and is projected from there: so is the cache.
                self._extend(i, *attn.project(core_out.to(store).to(core_out.dtype), None)[1:])
            core_out = layer.pos_ff(attn.residual(core_out, attn_vec))
        return core_out

    def _reserve(self, segment: SegmentSettings, bsz: int, qlen: int, dtype: torch.dtype, device) -> None:
        """Room for qlen more positions after the memory."""
        c = self.model.config
        capacity = self.buffers[0].shape[3] if self.buffers else 0
        if self.end + qlen <= capacity:
            return
        needed = 2 * (segment.mem_len + max(qlen, segment.tgt_len))
        if capacity < self.mlen + qlen or not self.buffers:
            capacity = max(needed, capacity)
        shape = (2, c.n_head, bsz, capacity, c.d_head)
        for i in range(c.n_layer):
            fresh = torch.empty(shape, dtype=dtype, device=device)
            if i < len(self.buffers):
                fresh[..., : self.mlen, :] = self.buffers[i][..., self.end - self.mlen : self.end, :]
                self.buffers[i] = fresh
            else:
                self.buffers.append(fresh)
        self.merged = [(b[0].view(-1, capacity, c.d_head), b[1].view(-1, capacity, c.d_head)) for b in self.buffers]
        self.end = self.mlen

    def _extend(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' keys and values [H, B, qlen, D] after the memory; views [H, B, mlen + qlen, D]
        of memory and new positions."""
        qlen = k_new.shape[2]
        keys, values = self.buffers[layer][0], self.buffers[layer][1]
        keys.narrow(2, self.end, qlen).copy_(k_new)
        values.narrow(2, self.end, qlen).copy_(v_new)
        start = self.end - self.mlen
        return keys.narrow(2, start, self.mlen + qlen), values.narrow(2, start, self.mlen + qlen)

    def _positions(
        self, segment: SegmentSettings, klen: int, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The per-layer position tables (see ``_position_table``), made once for at least klen distances."""
        model = self.model
        device = next(model.parameters()).device
        key = (segment.clamp_len, dtype, device)
        table = self._position_table
        if table is None or table[0] != key or table[1][0].shape[0] < klen:
            longest = max(klen, segment.mem_len + segment.tgt_len)
            pos_emb = sinusoid_encoding(
                relative_positions(longest, segment.clamp_len, device),
                model.config.d_model,
                dtype=torch.promote_types(dtype, torch.float32),
            ).to(dtype)
            rows = [layer.dec_attn.project_positions(pos_emb)[1:] for layer in model.layers]
            table = self._position_table = (key, rows, [r.permute(1, 2, 0).contiguous() for r in rows])
        return table[1], table[2]

    def _position_heads_for(self, segment: SegmentSettings, klen: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per layer [klen + 1, H, D]: a zero row, then r_net of the encodings of distances klen-1 .. 0."""
        if self._position_heads is not None and self._position_heads[0] == klen:
            return self._position_heads[1]
        rows, _ = self._positions(segment, klen, dtype)
        heads = [torch.cat([r.new_zeros(1, *r.shape[1:]), r[r.shape[0] - klen :]]) for r in rows]
        self._position_heads = (klen, heads)
        return heads

    def _position_columns(self, segment: SegmentSettings, klen: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per layer [H, D, klen] (views): r_net of the encodings of distances klen-1 .. 0, which are the distances
        of keys 0 .. klen-1 from a single query after them, so a one-token step needs no relative shift."""
        _, columns = self._positions(segment, klen, dtype)
        return [t[..., t.shape[-1] - klen :] for t in columns]

    def _query_biases_in(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per layer [2, H, 1, D]: u and v scaled by 1/sqrt(d_head) in ``dtype``, remade whenever a bias changes
        in place (an optimizer step in between bumps its version counter; a write through ``.data`` does not, so
        make a new cache after one). Biases made under ``torch.inference_mode`` have no version counter: remade
        for every token then (two operations per layer)."""
        key = None if any(t.is_inference() for t in self._biases) else (dtype, tuple(t._version for t in self._biases))
        if key is None or self._query_biases is None or self._query_biases[0] != key:
            weights = self.step_weights
            self._query_biases = (key, [(torch.stack([w.u, w.v]) * w.scale).to(dtype)[:, :, None, :] for w in weights])
        return self._query_biases[1]
