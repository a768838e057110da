"""The Transformer-XL language model (Dai et al., 2019). Pure torch: nothing distributed is imported here.

Layer: may import txl_dist.config and the bottom layer, never torch.distributed or DeepSpeed
(docs/architecture.md, Layers)."""

from txl_dist.config.model import PRESETS, ModelConfig, preset
from txl_dist.model.transformer import TransformerXLLM

__all__ = ["PRESETS", "ModelConfig", "TransformerXLLM", "preset"]
