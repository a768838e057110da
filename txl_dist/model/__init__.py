"""The Transformer-XL language model (Dai et al., 2019). Pure torch: nothing distributed is imported here.

Layer 2 (docs/architecture.md, Layers): may import layers 1-2; today txl_dist.config alone, never
torch.distributed or DeepSpeed."""

from txl_dist.config.model import PRESETS, ModelConfig, preset
from txl_dist.model.transformer import TransformerXLLM

__all__ = ["PRESETS", "ModelConfig", "TransformerXLLM", "preset"]
