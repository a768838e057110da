"""txl_dist: Transformer-XL language models trained with DeepSpeed ZeRO at One-Billion-Word scale."""

__version__ = "0.1.0"
