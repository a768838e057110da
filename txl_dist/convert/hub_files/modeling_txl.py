"""Transformer-XL (Dai et al., 2019, arXiv 1901.02860) for transformers, as trained by txl_dist.

Self-contained with memory_txl.py, attention_txl.py and adaptive_txl.py beside it: they import torch and transformers
only, and write out what the model is made of:

- relative multi-head attention as in section 3.3 of the paper: score(i, j) = (q_i + u)·k_j + (q_i + v)·W_R R_{i-j},
  with the sinusoid R of the relative distance, the relative shift, clamp_len and same_length;
- the segment-level recurrence: a memory of the last ``mem_len`` positions of every layer's input, carried from one
  call to the next as the model's cache (`TransformerXLMemory`), so that ``generate()`` runs one forward of one
  token per new token;
- the adaptive input embedding and the projected adaptive log-softmax (clusters at ``cutoffs``, widths
  ``d_embed // div_val**i``, tied weights and projections).

How a call reads its input. ``input_ids`` [batch, length] is read in segments of ``tgt_len`` tokens, the way the
model was trained and the way txl_dist evaluates and generates: a token sees the memory (the ``mem_len`` positions
before its segment) and the tokens of its segment up to itself. A call of one segment, or of one token, is
therefore exactly one step of the recurrence. Positions whose ``attention_mask`` is 0 are never attended to, and a
row's segments start at its first attended position of the call, so a left-padded row gives the same results as
the row alone.

Outputs: ``logits`` are log-probabilities over the whole vocabulary (from the adaptive softmax); with ``labels``
(batch-first, shifted inside, -100 ignored) ``loss`` is their mean negative log-likelihood and ``losses`` the
per-token values [batch, length - 1]; ``cache`` is the memory to pass to the next call.

The model and its memory are the ones of txl_dist (txl_dist.model.TransformerXLLM); txl_dist's tests hold the two
equal (per-token losses over segments with the memory, greedy generation). ``TransformerXLMemory.mems()`` gives the
memory in txl_dist's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .adaptive_txl import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax, Projection
from .attention_txl import DecoderLayer, RelPartialLearnableMultiHeadAttn, sinusoid_encoding
from .configuration_txl import TransformerXLConfig
from .memory_txl import TransformerXLMemory, keep_last, last_positions


@dataclass
class TransformerXLModelOutput(ModelOutput):
    """last_hidden_state [B, L, d_model]; cache: the memory after this call; hidden_states: the input of every
    layer and the last output, each [B, L, d_model] (with output_hidden_states)."""

    last_hidden_state: torch.FloatTensor | None = None
    cache: TransformerXLMemory | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class TransformerXLCausalLMOutput(ModelOutput):
    """loss: mean negative log-likelihood of the shifted labels; logits: log-probabilities [B, L', n_token];
    losses: per-token negative log-likelihood [B, L - 1] (0 where labels are -100); cache: the memory."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    losses: torch.FloatTensor | None = None
    cache: TransformerXLMemory | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


class TransformerXLPreTrainedModel(PreTrainedModel):
    config_class = TransformerXLConfig
    config: TransformerXLConfig
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The authors' initialisation: N(0, init_std) weights, embeddings and position biases, N(0, proj_init_std)
        projections, N(1, init_std) layer-norm gains, zero biases."""
        std, proj_std = self.config.init_std, self.config.proj_init_std
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight, 1.0, std)
            nn.init.zeros_(module.bias)
        elif isinstance(module, Projection):
            nn.init.normal_(module.weight, 0.0, proj_std)
        elif isinstance(module, RelPartialLearnableMultiHeadAttn) and module.r_w_bias is not None:
            nn.init.normal_(module.r_w_bias, 0.0, std)
            nn.init.normal_(module.r_r_bias, 0.0, std)
        elif isinstance(module, ProjectedAdaptiveLogSoftmax) and module.n_clusters:
            nn.init.normal_(module.cluster_weight, 0.0, std)
            nn.init.zeros_(module.cluster_bias)
        elif isinstance(module, TransformerXLModel) and module.r_w_bias is not None:
            nn.init.normal_(module.r_w_bias, 0.0, std)
            nn.init.normal_(module.r_r_bias, 0.0, std)


class TransformerXLModel(TransformerXLPreTrainedModel):
    """The decoder: token ids and a memory -> final hidden states and the next memory."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__(config)
        c = config
        self.word_emb = AdaptiveEmbedding(c)
        self.drop = nn.Dropout(c.dropout)
        if not c.untie_r:  # u and v shared by all layers, as in the authors' PyTorch code
            self.r_w_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(c.n_head, c.d_head))
        else:
            self.r_w_bias = self.r_r_bias = None
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layer))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.word_emb

    def empty_memory(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> TransformerXLMemory:
        c = self.config
        nothing = torch.zeros(batch_size, 0, c.d_model, device=device, dtype=dtype)
        heads = torch.zeros(batch_size, 0, c.n_head, c.d_head, device=device, dtype=dtype)
        return TransformerXLMemory(
            [nothing] * (c.n_layer + 1),
            [heads] * c.n_layer,
            [heads] * c.n_layer,
            torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
            0,
        )

    def _attended(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, L] bool: the positions of this call that may be attended to."""
        batch, length = input_ids.shape
        if attention_mask is None:
            return torch.ones(batch, length, dtype=torch.bool, device=input_ids.device)
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < length:
            raise ValueError(
                f"attention_mask: expected [batch, positions read so far + {length}] with batch={batch}, "
                f"got shape {list(attention_mask.shape)}"
            )
        return attention_mask[:, -length:].to(device=input_ids.device, dtype=torch.bool)

    def _checked_cache(
        self, input_ids: torch.Tensor | None, cache: TransformerXLMemory | None, inputs_embeds: torch.Tensor | None
    ) -> TransformerXLMemory | None:
        """The memory passed in (or None), after checking the inputs of the call."""
        if inputs_embeds is not None:
            raise ValueError(
                "inputs_embeds is not supported: Transformer-XL embeds token ids with its adaptive "
                "embedding; pass input_ids"
            )
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids: expected a [batch, length >= 1] tensor of token ids, got "
                f"{None if input_ids is None else list(input_ids.shape)}"
            )
        if cache is not None and not isinstance(cache, TransformerXLMemory):
            raise TypeError(
                f"cache: expected the TransformerXLMemory a previous call returned, got {type(cache).__name__}"
            )
        return cache

    def _visible(
        self, first: torch.Tensor, key_attended: torch.Tensor, start: int, end: int, mlen: int
    ) -> torch.Tensor:
        """[B, q, k] bool: the keys (the memory's m positions, then the block's q) that each query of the block
        [start, end) of the call sees; ``first`` [B] is where each row's segments start, ``key_attended`` [B, k]."""
        c = self.config
        device = first.device
        query_pos = torch.arange(start, end, device=device)  # [q]
        key_pos = torch.arange(start - mlen, end, device=device)  # [k]
        offset = (query_pos[None, :] - first[:, None]).clamp(min=0)  # [B, q]
        seg_start = query_pos[None, :] - offset % c.tgt_len
        lowest = seg_start - c.mem_len
        if c.same_length:
            lowest = torch.maximum(lowest, query_pos[None, :] - c.mem_len + 1)
        return (
            (key_pos[None, None, :] >= lowest[:, :, None])
            & (key_pos[None, None, :] <= query_pos[None, :, None])
            & key_attended[:, None, :]
        )

    def _position_embedding(self, klen: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """R [klen, d_model] for the distances klen - 1, ..., 0 (at most clamp_len), after dropout."""
        distances = torch.arange(klen - 1, -1, -1, device=device, dtype=torch.float32)
        if self.config.clamp_len > 0:
            distances = distances.clamp(max=self.config.clamp_len)
        return self.drop(sinusoid_encoding(distances, self.config.d_model).to(dtype))

    def _read_block(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        visible: torch.Tensor,
        work: TransformerXLMemory,
        keep: int,
        layer_inputs: list[list[torch.Tensor]] | None,
    ) -> torch.Tensor:
        """One block x [B, q, d_model] through every layer -> the last layer's output. The working memory ``work``
        gets the block's positions (its last ``keep`` kept); each layer's input is appended to ``layer_inputs[i]``
        when given."""
        mlen = work.hidden[0].shape[1]
        # Projected keys and values of the memory are reused only without autograd: in training the memory's
        # projections must get their gradients as in the authors' code.
        reuse = not torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if reuse or not mlen:
                mem_keys, mem_values = work.keys[i], work.values[i]
            else:
                mem_keys, mem_values = layer.dec_attn.project(work.hidden[i])[1:]
            if layer_inputs is not None:
                layer_inputs[i].append(x)
            new_hidden = keep_last(work.hidden[i], x.detach(), keep)
            x, key, value = layer(x, pos_emb, visible, mem_keys, mem_values, self.r_w_bias, self.r_r_bias)
            work.keys[i] = keep_last(work.keys[i], key.detach(), keep)
            work.values[i] = keep_last(work.values[i], value.detach(), keep)
            work.hidden[i] = new_hidden
        work.hidden[-1] = keep_last(work.hidden[-1], x.detach(), keep)
        return x

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: TransformerXLMemory | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: TransformerXLMemory | None = None,
        **kwargs,
    ) -> TransformerXLModelOutput:
        c = self.config
        cache = self._checked_cache(
            input_ids, cache if cache is not None else past_key_values, kwargs.get("inputs_embeds")
        )
        use_cache = c.use_cache if use_cache is None else use_cache
        output_hidden_states = c.output_hidden_states if output_hidden_states is None else output_hidden_states
        batch, length = input_ids.shape
        embedded = self.drop(self.word_emb(input_ids))
        device, dtype = embedded.device, embedded.dtype
        memory = cache if cache is not None else self.empty_memory(batch, device, dtype)
        if memory.attended.shape[0] != batch:
            raise ValueError(f"cache: holds {memory.attended.shape[0]} rows, but input_ids has {batch}")
        attended = self._attended(input_ids, attention_mask)

        # A row's segments start at its first attended position of the call; a block of tgt_len positions of the
        # call may then straddle two of a padded row's segments, whose tokens see up to tgt_len - 1 positions
        # further back than the block start: the memory kept inside the call is that much longer.
        positions = torch.arange(length, device=device)
        first = torch.where(attended, positions, length).amin(dim=1)  # [B]
        keep = c.mem_len + int(((-first) % c.tgt_len).max())
        work = TransformerXLMemory(
            list(memory.hidden), list(memory.keys), list(memory.values), memory.attended, memory.seen
        )
        # Per block: the input of every layer and the last output (all of them only for output_hidden_states).
        layer_inputs: list[list[torch.Tensor]] = [[] for _ in range(c.n_layer + 1)]
        for start in range(0, length, c.tgt_len):
            end, mlen = min(start + c.tgt_len, length), work.hidden[0].shape[1]
            key_attended = torch.cat([work.attended, attended[:, start:end]], dim=1)  # [B, k]
            visible = self._visible(first, key_attended, start, end, mlen)
            pos_emb = self._position_embedding(mlen + end - start, device, dtype)
            x = self._read_block(
                embedded[:, start:end], pos_emb, visible, work, keep, layer_inputs if output_hidden_states else None
            )
            layer_inputs[c.n_layer].append(x)
            work.attended = keep_last(work.attended, attended[:, start:end], keep)

        outputs = [torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] for parts in layer_inputs if parts]
        return TransformerXLModelOutput(
            last_hidden_state=self.drop(outputs[-1]),
            cache=last_positions(work, c.mem_len, memory.seen + length) if use_cache else None,
            hidden_states=tuple(outputs) if output_hidden_states else None,
        )


class TransformerXLForCausalLM(TransformerXLPreTrainedModel, GenerationMixin):
    """Transformer-XL with its adaptive softmax: `generate()` carries the memory as the cache."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__(config)
        self.transformer = TransformerXLModel(config)
        self.crit = ProjectedAdaptiveLogSoftmax(config)
        # The ties of tie_weight / tie_projs, for transformers to make after loading (each tied tensor is stored
        # once, under the embedding's name).
        tied = {}
        if config.tie_weight:
            for i in range(len(self.crit.out_layers)):
                tied[f"crit.out_layers.{i}.weight"] = f"transformer.word_emb.emb_layers.{i}.weight"
        for i, tie in enumerate(config.tie_projs):
            if tie and str(i) in self.crit.out_projs:
                source = "0" if config.div_val == 1 else str(i)
                tied[f"crit.out_projs.{i}.weight"] = f"transformer.word_emb.emb_projs.{source}.weight"
        self._tied_weights_keys = tied
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The cache is the Transformer-XL memory, which the model creates and returns itself.
        return False

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.word_emb

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        cache: TransformerXLMemory | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: TransformerXLMemory | None = None,
        **kwargs,
    ) -> TransformerXLCausalLMOutput:
        """input_ids [B, L] (and labels [B, L], shifted inside) -> log-probabilities, loss, the next memory.
        ``logits_to_keep`` > 0 computes the log-probabilities of the last positions only."""
        out = self.transformer(
            input_ids,
            cache=cache if cache is not None else past_key_values,
            attention_mask=attention_mask,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        hidden = out.last_hidden_state
        batch, length, d_model = hidden.shape
        loss = losses = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels: expected the shape of input_ids {list(input_ids.shape)}, got {list(labels.shape)}"
                )
            targets = labels[:, 1:].to(hidden.device)
            scored = targets != -100
            bad = targets[scored]
            if bad.numel() and (int(bad.min()) < 0 or int(bad.max()) >= self.config.n_token):
                raise ValueError(f"labels: ids must lie in [0, {self.config.n_token}) or be -100")
            losses = torch.zeros(batch, length - 1, dtype=torch.float32, device=hidden.device)
            flat_hidden = hidden[:, :-1][scored]
            losses[scored] = self.crit.nll(flat_hidden, targets[scored])
            loss = losses.sum() / scored.sum().clamp(min=1)
        kept = hidden if not logits_to_keep else hidden[:, -logits_to_keep:]
        logits = self.crit.log_prob(kept.reshape(-1, d_model)).view(batch, kept.shape[1], -1)
        return TransformerXLCausalLMOutput(
            loss=loss, logits=logits, losses=losses, cache=out.cache, hidden_states=out.hidden_states
        )


__all__ = ["TransformerXLForCausalLM", "TransformerXLMemory", "TransformerXLModel", "TransformerXLPreTrainedModel"]
