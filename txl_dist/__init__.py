"""txl_dist: Transformer-XL language models trained with DeepSpeed ZeRO at One-Billion-Word scale."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def load_pretrained(export_dir: Any, **overrides: Any) -> tuple[Any, Any]:
    """(model, tokenizer or None) of an export folder: see `txl_dist.export.load_pretrained`.

    Imported on first use, so that ``import txl_dist`` stays light (no torch).
    """
    from txl_dist.export import load_pretrained as _load_pretrained

    return _load_pretrained(export_dir, **overrides)
