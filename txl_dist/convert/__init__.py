"""Checkpoint and weight conversions: HuggingFace TransfoXL, the authors' PyTorch layout, exports.

Layer: may import every package below it (checkpoints, export, model, tokenizer, data, config, the bottom
layer), never training, downstream or the launchers (docs/architecture.md, Layers)."""
