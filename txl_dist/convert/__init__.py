"""Checkpoint and weight conversions: HuggingFace TransfoXL, the authors' PyTorch layout, exports.

`cli` holds the subcommands of launchers/convert.py.

Layer: may import every package below it (docs/architecture.md, Layers); today checkpoints, export, model,
tokenizer, data, config and the bottom layer, nothing of training. Never downstream or the launchers."""
