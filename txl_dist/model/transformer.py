"""Transformer-XL language model: segment recurrence over relative-attention decoder layers.

Shapes: the public `forward` takes tokens batch-first, [B, L]; inside, hidden states are time-major,
[L, B, d_model], as in the authors' code, and so is the memory: a list of n_layer + 1 tensors
[mem_len, B, d_model] (the embedding output, then every layer's output), detached, the oldest positions dropped.
Decoding with a key/value cache is in `txl_dist.model.decoding`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from txl_dist.config.model import ModelConfig
from txl_dist.model.adaptive import AdaptiveEmbedding, ClusterRows, ProjectedAdaptiveLogSoftmax
from txl_dist.model.attention import (
    RelPartialLearnableMultiHeadAttn,
    attention_mask,
    cached_attention_mask,
    may_mask_whole_rows,
    relative_positions,
    sinusoid_encoding,
)
from txl_dist.model.dropout import Dropout
from txl_dist.model.recurrence import MEM_DTYPES, SegmentSettings


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


class TransformerXLLM(nn.Module):
    """`forward(tokens, targets=None, mems=None) -> (loss [B, L] or log_probs [B, L, n_token], new_mems)`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = dataclasses.replace(config).validate()
        c = self.config
        # The settings of training; evaluation and decoding may pass others in (the config stays as built).
        self.segment = SegmentSettings.of(c)
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
        self, tokens: torch.Tensor, mems: list[torch.Tensor] | None = None, segment: SegmentSettings | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, L] -> (final hidden states [L, B, d_model], new mems). ``segment``: other settings than
        the model's own (`self.segment`), e.g. for evaluation; the weights do not depend on them."""
        compiled = self.__dict__.get("_compiled_hidden_states")
        return (compiled or self._hidden_states)(tokens, mems, segment or self.segment)

    def _hidden_states(
        self, tokens: torch.Tensor, mems: list[torch.Tensor] | None, segment: SegmentSettings
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [batch, length], got shape {list(tokens.shape)}")
        inp = tokens.t()  # [L, B]
        qlen, bsz = inp.shape
        mlen = 0 if mems is None else self._check_mems(mems, bsz)
        word_emb = self.word_emb(inp)
        build_mask = attention_mask if torch.compiler.is_compiling() else cached_attention_mask
        mask = build_mask(qlen, mlen, segment.mem_len, segment.same_length, inp.device)
        may_mask_rows = may_mask_whole_rows(segment.mem_len, segment.same_length)
        core_out = self.drop(word_emb)
        pos_emb = sinusoid_encoding(
            relative_positions(mlen + qlen, segment.clamp_len, inp.device),
            self.config.d_model,
            dtype=torch.promote_types(core_out.dtype, torch.float32),
        )
        pos_emb = self.drop(pos_emb.to(core_out.dtype))
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            core_out = layer(
                core_out, pos_emb, mask, None if mems is None else mems[i], self.r_w_bias, self.r_r_bias, may_mask_rows
            )
            hids.append(core_out)
        new_mems = self._update_mems(hids, mems, qlen, segment.mem_len)
        return self.drop(core_out), new_mems

    @torch.no_grad()
    def _update_mems(
        self, hids: list[torch.Tensor], mems: list[torch.Tensor] | None, qlen: int, mem_len: int
    ) -> list[torch.Tensor]:
        """Keep the newest mem_len positions of [old mems ; this segment], per layer."""
        dtype = MEM_DTYPES[self.config.mem_dtype]
        new_mems = []
        for i, hid in enumerate(hids):
            if mems is None or mems[i].shape[0] == 0 or qlen >= mem_len:
                new = hid[max(0, qlen - mem_len) :]
            else:
                new = torch.cat([mems[i].to(hid.dtype), hid], dim=0)[-mem_len:]
            new_mems.append(new.detach().to(dtype or hid.dtype))
        return new_mems

    def cluster_rows(self, targets: torch.Tensor, device: torch.device | str | None = None) -> ClusterRows:
        """Which positions of ``targets`` [B, L] fall in each tail cluster of the adaptive softmax (see
        `ProjectedAdaptiveLogSoftmax.cluster_rows`), as row indices on ``device``. Made from targets on the host,
        they let `forward` on an accelerator run without waiting for the device."""
        return self.crit.cluster_rows(targets.t().reshape(-1), device)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        mems: list[torch.Tensor] | None = None,
        cluster_rows: ClusterRows | None = None,
        segment: SegmentSettings | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, L] (and targets [B, L]) -> (per-token loss [B, L], new mems), or without targets
        (log-probabilities [B, L, n_token], new mems). Losses and log-probabilities are float32.
        ``cluster_rows`` = `cluster_rows` of the targets, made on the host (optional); ``segment``: settings
        other than the model's own (see `hidden_states`)."""
        hidden, new_mems = self.hidden_states(tokens, mems, segment)
        qlen, bsz, d_model = hidden.shape
        flat = hidden.reshape(qlen * bsz, d_model)
        if targets is None:
            return self.crit.log_prob(flat).view(qlen, bsz, -1).transpose(0, 1), new_mems
        if targets.shape != tokens.shape:
            raise ValueError(f"targets: expected shape {list(tokens.shape)}, got {list(targets.shape)}")
        loss = self.crit(flat, targets.t().reshape(-1), cluster_rows).view(qlen, bsz).t()
        return loss, new_mems
