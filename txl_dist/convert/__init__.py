"""Checkpoint and weight conversions: HuggingFace TransfoXL, the authors' PyTorch layout, exports."""
