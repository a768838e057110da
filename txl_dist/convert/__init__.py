"""Checkpoint and weight conversions: HuggingFace TransfoXL, the authors' PyTorch layout, exports.

`cli` holds the subcommands of launchers/convert.py.

Layer 6 (docs/architecture.md, Layers): may import layers 1-6; today checkpoints, export, model, tokenizer, data,
config and the bottom layer, nothing of training. Never downstream or the launchers."""
