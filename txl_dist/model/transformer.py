"""Transformer-XL language model: segment recurrence over relative-attention decoder layers.

Shapes: the public `forward` takes tokens batch-first, [B, L]; inside, hidden states are time-major,
[L, B, d_model], as in the authors' code, and so is the memory: a list of n_layer + 1 tensors
[mem_len, B, d_model] (the embedding output, then every layer's output), detached, the oldest positions dropped.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from txl_dist.model.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax, TargetPlan
from txl_dist.model.attention import (
    RelPartialLearnableMultiHeadAttn,
    attention_mask,
    cached_attention_mask,
    may_mask_whole_rows,
    relative_positions,
    sinusoid_encoding,
)
from txl_dist.model.config import ModelConfig
from txl_dist.model.dropout import Dropout

_MEM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PositionwiseFF(nn.Module):
    def __init__(self, d_model: int, d_inner: int, dropout: float, pre_lnorm: bool, layer_norm_eps: float):
        super().__init__()
        self.pre_lnorm = pre_lnorm
        # Index 0 and 3 are the two linear maps; the name and layout follow the authors' code. The ReLU is not
        # in place: in place on the (viewed) output of the first map, autograd would rebuild that output in the
        # backward pass (CopySlices), which costs more than the allocation it saves.
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner),
            nn.ReLU(),
            Dropout(dropout),
            nn.Linear(d_inner, d_model),
            Dropout(dropout),
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_lnorm:
            return x + self.CoreNet(self.layer_norm(x))
        return self.layer_norm(x + self.CoreNet(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(
            config.n_head,
            config.d_model,
            config.d_head,
            config.dropout,
            config.dropatt,
            config.pre_lnorm,
            config.layer_norm_eps,
            config.attn_impl,
            own_position_biases=config.untie_r,
        )
        self.pos_ff = PositionwiseFF(
            config.d_model, config.d_inner, config.dropout, config.pre_lnorm, config.layer_norm_eps
        )

    def forward(self, x, pos_emb, mask, mem, r_w_bias, r_r_bias, may_mask_rows=True):
        return self.pos_ff(self.dec_attn(x, pos_emb, mask, mem, r_w_bias, r_r_bias, may_mask_rows=may_mask_rows))

    def step_weights(self, r_w_bias: torch.Tensor | None, r_r_bias: torch.Tensor | None) -> StepWeights:
        """The tensors and settings `decode_step` needs, gathered once per decoding (looking parameters up through
        the modules for every token would cost more than some of the operations). The position biases are the
        layer's own (untie_r) or the given shared ones."""
        attn, ff = self.dec_attn, self.pos_ff
        own = attn.r_w_bias is not None
        return StepWeights(
            attn.r_w_bias if own else r_w_bias,
            attn.r_r_bias if own else r_r_bias,
            attn.pre_lnorm,
            attn.n_head,
            attn.d_head,
            attn.scale,
            attn.layer_norm.normalized_shape,
            (attn.layer_norm.weight, attn.layer_norm.bias, attn.layer_norm.eps),
            attn.qkv_net.weight,
            attn.o_net.weight,
            ff.CoreNet[0].weight,
            ff.CoreNet[0].bias,
            ff.CoreNet[3].weight,
            ff.CoreNet[3].bias,
            (ff.layer_norm.weight, ff.layer_norm.bias, ff.layer_norm.eps),
        )


class StepWeights(NamedTuple):
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
    """A decoder layer (``w`` = its `DecoderLayer.step_weights`) for one new position per sequence, in inference
    (no dropout, no autograd): x [B, d_model] -> [B, d_model], equal to the layer's `forward` of that position
    with the memory.

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
    """What `TransformerXLLM.hidden_states_cached` carries between calls: per layer the keys and values of the
    memory, and the position encodings projected by every layer's r_net.

    Keys and values live in one preallocated buffer [2, H, B, capacity, D] per layer (keys at 0, values at 1); a
    call writes the new positions after the memory and attends over a view of [memory ; new], so the memory is
    neither projected nor copied again. When the buffer is full the memory (at most mem_len positions) moves to
    its front, once every capacity - mem_len positions."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.merged: list[tuple[torch.Tensor, torch.Tensor]] = []  # per buffer: keys, values as [H*B, capacity, D]
        self.end = 0  # buffer index after the newest position
        self.mlen = 0  # positions of memory before ``end``
        # (clamp_len, dtype, device) -> per layer r_net of the encodings of distances longest-1 .. 0: [longest, H, D]
        # and the same as [H, D, longest] (contiguous, for one-token steps).
        self._position_table: tuple[tuple, list[torch.Tensor], list[torch.Tensor]] | None = None
        self._position_heads: tuple[int, list[torch.Tensor]] | None = None
        self._query_biases: tuple[tuple, list[torch.Tensor]] | None = None
        self.step_weights: list[StepWeights] | None = None  # per layer, for one-token steps (`decode_step`)

    @property
    def batch_size(self) -> int | None:
        return self.buffers[0].shape[2] if self.buffers else None

    def keys(self, layer: int) -> torch.Tensor:
        return self.buffers[layer][0]

    def values(self, layer: int) -> torch.Tensor:
        return self.buffers[layer][1]

    def reserve(self, model: TransformerXLLM, bsz: int, qlen: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for qlen more positions after the memory."""
        c = model.config
        capacity = self.buffers[0].shape[3] if self.buffers else 0
        if self.end + qlen <= capacity:
            return
        needed = 2 * (c.mem_len + max(qlen, c.tgt_len))
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

    def extend(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' keys and values [H, B, qlen, D] after the memory; views [H, B, mlen + qlen, D]
        of memory and new positions."""
        qlen = k_new.shape[2]
        keys, values = self.keys(layer), self.values(layer)
        keys.narrow(2, self.end, qlen).copy_(k_new)
        values.narrow(2, self.end, qlen).copy_(v_new)
        start = self.end - self.mlen
        return keys.narrow(2, start, self.mlen + qlen), values.narrow(2, start, self.mlen + qlen)

    def advance(self, qlen: int, mem_len: int) -> None:
        """After every layer has extended: the new positions join the memory, which keeps the newest mem_len."""
        self.end += qlen
        self.mlen = min(mem_len, self.mlen + qlen)

    def _positions(
        self, model: TransformerXLLM, klen: int, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The per-layer position tables (see ``_position_table``), made once for at least klen distances."""
        c = model.config
        device = next(model.parameters()).device
        key = (c.clamp_len, dtype, device)
        table = self._position_table
        if table is None or table[0] != key or table[1][0].shape[0] < klen:
            longest = max(klen, c.mem_len + c.tgt_len)
            pos_emb = sinusoid_encoding(
                relative_positions(longest, c.clamp_len, device),
                c.d_model,
                dtype=torch.promote_types(dtype, torch.float32),
            ).to(dtype)
            rows = [layer.dec_attn.project_positions(pos_emb)[1:] for layer in model.layers]
            table = self._position_table = (key, rows, [r.permute(1, 2, 0).contiguous() for r in rows])
        return table[1], table[2]

    def position_heads(self, model: TransformerXLLM, klen: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per layer [klen + 1, H, D]: a zero row, then r_net of the encodings of distances klen-1 .. 0."""
        if self._position_heads is not None and self._position_heads[0] == klen:
            return self._position_heads[1]
        rows, _ = self._positions(model, klen, dtype)
        heads = [torch.cat([r.new_zeros(1, *r.shape[1:]), r[r.shape[0] - klen :]]) for r in rows]
        self._position_heads = (klen, heads)
        return heads

    def position_columns(self, model: TransformerXLLM, klen: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per layer [H, D, klen] (views): r_net of the encodings of distances klen-1 .. 0, which are the distances
        of keys 0 .. klen-1 from a single query after them, so a one-token step needs no relative shift."""
        _, columns = self._positions(model, klen, dtype)
        return [t[..., t.shape[-1] - klen :] for t in columns]

    def layer_weights(self, model: TransformerXLLM) -> list[StepWeights]:
        """Per layer `DecoderLayer.step_weights`, gathered on first use."""
        if self.step_weights is None:
            self.step_weights = [layer.step_weights(model.r_w_bias, model.r_r_bias) for layer in model.layers]
            self._biases = list({id(t): t for w in self.step_weights for t in (w.u, w.v)}.values())
        return self.step_weights

    def query_biases(self, model: TransformerXLLM, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per layer [2, H, 1, D]: u and v scaled by 1/sqrt(d_head) in ``dtype``, remade whenever a bias changes
        in place (an optimizer step in between bumps its version counter; a write through ``.data`` does not, so
        make a new cache after one). Biases made under ``torch.inference_mode`` have no version counter: remade
        for every token then (two operations per layer)."""
        weights = self.layer_weights(model)
        key = None if any(t.is_inference() for t in self._biases) else (dtype, tuple(t._version for t in self._biases))
        if key is None or self._query_biases is None or self._query_biases[0] != key:
            self._query_biases = (key, [(torch.stack([w.u, w.v]) * w.scale).to(dtype)[:, :, None, :] for w in weights])
        return self._query_biases[1]


class TransformerXLLM(nn.Module):
    """`forward(tokens, targets=None, mems=None) -> (loss [B, L] or log_probs [B, L, n_token], new_mems)`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = dataclasses.replace(config).validate()
        c = self.config
        d_embed = c.d_embed_resolved
        self.word_emb = AdaptiveEmbedding(c.n_token, d_embed, c.d_model, c.cutoffs, c.div_val)
        self.drop = Dropout(c.dropout)
        if not c.untie_r:  # u and v shared by all layers, as in the authors' PyTorch code
            self.r_w_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
            self.r_r_bias = nn.Parameter(torch.empty(c.n_head, c.d_head))
        else:
            self.r_w_bias = self.r_r_bias = None
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layer))
        self.crit = ProjectedAdaptiveLogSoftmax(c.n_token, d_embed, c.d_model, c.cutoffs, c.div_val)
        self._tie_weights()
        self.reset_parameters()

    def _tie_weights(self) -> None:
        c = self.config
        if c.tie_weight:
            for i, out_layer in enumerate(self.crit.out_layers):
                out_layer.weight = self.word_emb.emb_layers[i].weight
        for i, tie in enumerate(c.tie_projs_resolved):
            if not tie:
                continue
            if c.div_val == 1 and c.d_model != c.d_embed_resolved:
                self.crit.out_projs[i] = self.word_emb.emb_projs[0]
            elif c.div_val != 1:
                self.crit.out_projs[i] = self.word_emb.emb_projs[i]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The authors' initialisation: N(0, init_std) weights and embeddings, N(0, proj_init_std) projections,
        N(1, init_std) layer-norm gains, zero biases."""
        std, proj_std = self.config.init_std, self.config.proj_init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, RelPartialLearnableMultiHeadAttn) and module.r_w_bias is not None:
                nn.init.normal_(module.r_w_bias, 0.0, std)
                nn.init.normal_(module.r_r_bias, 0.0, std)
        for proj in list(self.word_emb.emb_projs) + list(self.crit.out_projs):
            if proj is not None:
                nn.init.normal_(proj, 0.0, proj_std)
        if self.crit.n_clusters > 0:
            nn.init.normal_(self.crit.cluster_weight, 0.0, std)
            nn.init.zeros_(self.crit.cluster_bias)
        if self.r_w_bias is not None:
            nn.init.normal_(self.r_w_bias, 0.0, std)
            nn.init.normal_(self.r_r_bias, 0.0, std)

    def num_parameters(self) -> int:
        """Parameters counted once each (tied weights and projections are shared)."""
        return sum(p.numel() for p in self.parameters())

    def reset_length(
        self, *, mem_len: int | None = None, clamp_len: int | None = None, same_length: bool | None = None
    ) -> None:
        """Change the segment settings (e.g. for evaluation); the weights do not depend on them."""
        changes = {
            k: v
            for k, v in (("mem_len", mem_len), ("clamp_len", clamp_len), ("same_length", same_length))
            if v is not None
        }
        self.config = dataclasses.replace(self.config, **changes).validate()

    def _check_mems(self, mems: list[torch.Tensor], batch_size: int) -> int:
        if len(mems) != self.config.n_layer + 1:
            raise ValueError(f"mems: expected n_layer + 1 = {self.config.n_layer + 1} tensors, got {len(mems)}")
        mlen = mems[0].shape[0]
        for i, mem in enumerate(mems):
            if mem.dim() != 3 or mem.shape != (mlen, batch_size, self.config.d_model):
                raise ValueError(
                    f"mems[{i}]: expected shape [{mlen}, {batch_size}, {self.config.d_model}], got {list(mem.shape)}"
                )
        return mlen

    def compile_body(self, **options) -> None:
        """Run `hidden_states` (embedding, layers, memory: nearly all the work) through ``torch.compile`` from
        now on. The adaptive softmax stays eager: its row selections have host-planned, data-dependent sizes,
        and a graph broken inside the loss lost the gradient of the hidden states in torch 2.13. Parameters and
        state-dict keys are unchanged."""
        self._compiled_hidden_states = torch.compile(self._hidden_states, **options)

    def hidden_states(
        self, tokens: torch.Tensor, mems: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, L] -> (final hidden states [L, B, d_model], new mems)."""
        compiled = self.__dict__.get("_compiled_hidden_states")
        return (compiled or self._hidden_states)(tokens, mems)

    def _hidden_states(
        self, tokens: torch.Tensor, mems: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        c = self.config
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [batch, length], got shape {list(tokens.shape)}")
        inp = tokens.t()  # [L, B]
        qlen, bsz = inp.shape
        mlen = 0 if mems is None else self._check_mems(mems, bsz)
        word_emb = self.word_emb(inp)
        build_mask = attention_mask if torch.compiler.is_compiling() else cached_attention_mask
        mask = build_mask(qlen, mlen, c.mem_len, c.same_length, inp.device)
        may_mask_rows = may_mask_whole_rows(c.mem_len, c.same_length)
        core_out = self.drop(word_emb)
        pos_emb = sinusoid_encoding(
            relative_positions(mlen + qlen, c.clamp_len, inp.device),
            c.d_model,
            dtype=torch.promote_types(core_out.dtype, torch.float32),
        )
        pos_emb = self.drop(pos_emb.to(core_out.dtype))
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            core_out = layer(
                core_out, pos_emb, mask, None if mems is None else mems[i], self.r_w_bias, self.r_r_bias, may_mask_rows
            )
            hids.append(core_out)
        new_mems = self._update_mems(hids, mems, qlen)
        return self.drop(core_out), new_mems

    # ---- incremental decoding with a key/value cache ------------------------------------------------------------

    @torch.no_grad()
    def hidden_states_cached(self, tokens: torch.Tensor, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Like `hidden_states`, for inference: tokens [B, L] after everything ``cache`` has seen -> (final hidden
        states [L, B, d_model], the cache, updated in place, for the next call).

        The cache holds, per layer, the keys and values of the memory and the projected position encodings, so
        a new token projects only itself: the memory is never projected again. It covers exactly the positions
        the memory would hold (the newest mem_len), so the outputs equal those of `hidden_states` with the
        memory. Dropout is off (call it in eval mode)."""
        c = self.config
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [batch, length], got shape {list(tokens.shape)}")
        inp = tokens.t()  # [L, B]
        qlen, bsz = inp.shape
        cache = KVCache() if cache is None else cache
        if cache.batch_size not in (None, bsz):
            raise ValueError(f"tokens: batch {bsz}, but the cache holds batch {cache.batch_size}")
        core_out = self.drop(self.word_emb(inp))
        cache.reserve(self, bsz, qlen, core_out.dtype, inp.device)
        mlen = cache.mlen
        store = _MEM_DTYPES.get(c.mem_dtype)
        if (
            qlen == 1
            and not self.training
            and (store is None or store == core_out.dtype)
            and not may_mask_whole_rows(c.mem_len, c.same_length)
        ):
            # One new token (every step of generation): `decode_step`, a few operations per layer.
            # The query sees the whole memory, or with same_length the newest mem_len - 1 of it (and itself).
            first = cache.end - (min(mlen, c.mem_len - 1) if c.same_length else mlen)
            columns = cache.position_columns(self, cache.end + 1 - first, core_out.dtype)
            biases = cache.query_biases(self, core_out.dtype)
            x = core_out[0]
            for i, weights in enumerate(cache.step_weights):
                x = decode_step(weights, x, cache.buffers[i], cache.merged[i], cache.end, first, columns[i], biases[i])
            cache.advance(1, c.mem_len)
            return x.unsqueeze(0), cache
        # A single new token sees every key, unless same_length drops the oldest once the memory is full.
        masks_nothing = qlen == 1 and not (c.same_length and mlen >= c.mem_len)
        mask = None if masks_nothing else cached_attention_mask(qlen, mlen, c.mem_len, c.same_length, inp.device)
        may_mask_rows = may_mask_whole_rows(c.mem_len, c.same_length)
        r_heads = cache.position_heads(self, mlen + qlen, core_out.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.dec_attn
            q, k_new, v_new = attn.project(core_out, None)
            k, v = cache.extend(i, k_new, v_new)
            attn_vec = attn.attend(q, k, v, r_heads[i], self.r_w_bias, self.r_r_bias, mask, may_mask_rows)
            if store is not None and store != core_out.dtype:
                # The memory keeps this layer's input in mem_dtype and is projected from there: so is the cache.
                cache.extend(i, *attn.project(core_out.to(store).to(core_out.dtype), None)[1:])
            core_out = layer.pos_ff(attn.residual(core_out, attn_vec))
        cache.advance(qlen, c.mem_len)
        return self.drop(core_out), cache

    @torch.no_grad()
    def _update_mems(self, hids: list[torch.Tensor], mems: list[torch.Tensor] | None, qlen: int) -> list[torch.Tensor]:
        """Keep the newest mem_len positions of [old mems ; this segment], per layer."""
        mem_len = self.config.mem_len
        dtype = _MEM_DTYPES.get(self.config.mem_dtype)
        new_mems = []
        for i, hid in enumerate(hids):
            if mems is None or mems[i].shape[0] == 0 or qlen >= mem_len:
                new = hid[max(0, qlen - mem_len) :]
            else:
                new = torch.cat([mems[i].to(hid.dtype), hid], dim=0)[-mem_len:]
            new_mems.append(new.detach().to(dtype or hid.dtype))
        return new_mems

    def plan_targets(self, targets: torch.Tensor, device: torch.device | str | None = None) -> TargetPlan:
        """The adaptive softmax's plan for ``targets`` [B, L] (see `ProjectedAdaptiveLogSoftmax.plan`), with its
        row indices on ``device``. Made from targets on the host, it lets `forward` on an accelerator run without
        waiting for the device."""
        return self.crit.plan(targets.t().reshape(-1), device)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        mems: list[torch.Tensor] | None = None,
        target_plan: TargetPlan | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, L] (and targets [B, L]) -> (per-token loss [B, L], new mems), or without targets
        (log-probabilities [B, L, n_token], new mems). Losses and log-probabilities are float32.
        ``target_plan`` = `plan_targets` of the targets, made on the host (optional)."""
        hidden, new_mems = self.hidden_states(tokens, mems)
        qlen, bsz, d_model = hidden.shape
        flat = hidden.reshape(qlen * bsz, d_model)
        if targets is None:
            return self.crit.log_prob(flat).view(qlen, bsz, -1).transpose(0, 1), new_mems
        if targets.shape != tokens.shape:
            raise ValueError(f"targets: expected shape {list(tokens.shape)}, got {list(targets.shape)}")
        loss = self.crit(flat, targets.t().reshape(-1), target_plan).view(qlen, bsz).t()
        return loss, new_mems
