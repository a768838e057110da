"""Configuration of a Transformer-XL language model exported by txl_dist (`launchers/convert.py export-to-hub`).

Self-contained: it imports transformers only. The field names are those of the authors' code (n_token, d_model,
div_val, ...), as in txl_dist's export config.json, so one reads the same in both places.
"""

from __future__ import annotations

from transformers import PreTrainedConfig


class TransformerXLConfig(PreTrainedConfig):
    """Architecture and segment settings of `TransformerXLForCausalLM` (see modeling_txl.py)."""

    model_type = "txl_dist_transformer_xl"
    attribute_map = {
        "vocab_size": "n_token",
        "hidden_size": "d_model",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    n_token: int = 10000
    """Vocabulary size."""
    n_layer: int = 16
    """Decoder layers."""
    n_head: int = 10
    """Attention heads per layer."""
    d_head: int = 41
    """Width of each head."""
    d_model: int = 410
    """Width of the residual stream and of the memory."""
    d_inner: int = 2100
    """Hidden width of the position-wise feed-forward network."""
    d_embed: int = 410
    """Width of the first embedding cluster (projected to d_model when different)."""
    div_val: int = 1
    """Cluster i of the adaptive embedding/softmax has width d_embed // div_val**i."""
    cutoffs: list[int] | None = None
    """Vocabulary cut points of the adaptive softmax clusters; empty for a full softmax."""
    tie_weight: bool = True
    """Each output cluster's weight is its input embedding cluster's."""
    tie_projs: list[bool] | None = None
    """Per cluster (head first): the output projection is the input projection."""
    untie_r: bool = False
    """Position biases u (r_w_bias) and v (r_r_bias) per layer instead of one pair for all layers."""
    pre_lnorm: bool = False
    """Layer norm before each sub-layer instead of after the residual sum."""
    dropout: float = 0.1
    """Dropout on embeddings, position encodings, sub-layer outputs and final hidden states."""
    dropatt: float = 0.0
    """Dropout on attention probabilities."""
    tgt_len: int = 150
    """Segment length: a forward reads its input in segments of this many tokens, as the model was trained."""
    mem_len: int = 150
    """Positions of memory per layer carried to the next segment (the cache)."""
    clamp_len: int = -1
    """Relative distances beyond this use the encoding of clamp_len; <= 0 disables clamping."""
    same_length: bool = False
    """Every query attends to the same number of positions (mem_len, itself included)."""
    layer_norm_eps: float = 1e-5
    """Epsilon of every layer norm."""
    init_std: float = 0.02
    """Standard deviation of the initialisation of weights, embeddings and position biases."""
    proj_init_std: float = 0.01
    """Standard deviation of the initialisation of the adaptive embedding/softmax projections."""
    use_cache: bool = True
    """Return the memory (`TransformerXLMemory`) so that the next call continues the text."""
    tie_word_embeddings: bool = True
    """Whether any weight is tied (tie_weight or a tie_projs entry); the ties themselves follow those two fields."""

    def __post_init__(self, **kwargs):
        self.cutoffs = list(self.cutoffs or [])
        clusters = len(self.cutoffs) + 1
        self.tie_projs = [False] + [True] * (clusters - 1) if self.tie_projs is None else list(self.tie_projs)
        problems = []
        for name in ("n_token", "n_layer", "n_head", "d_head", "d_model", "d_inner", "d_embed", "div_val", "tgt_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.mem_len, int) or self.mem_len < 0:
            problems.append(f"mem_len={self.mem_len!r} must be an integer >= 0")
        if any(b <= a for a, b in zip(self.cutoffs, self.cutoffs[1:])) or (
            self.cutoffs and not 0 < self.cutoffs[0] <= self.cutoffs[-1] < self.n_token
        ):
            problems.append(f"cutoffs={self.cutoffs} must increase strictly within (0, n_token={self.n_token})")
        if len(self.tie_projs) != clusters:
            problems.append(f"tie_projs={self.tie_projs} needs one entry per cluster ({clusters})")
        if self.same_length and self.mem_len == 0:
            problems.append("same_length=true needs mem_len > 0")
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        has_projections = self.div_val > 1 or self.d_embed != self.d_model
        self.tie_word_embeddings = bool(self.tie_weight or (has_projections and any(self.tie_projs)))
        super().__post_init__(**kwargs)


__all__ = ["TransformerXLConfig"]
