"""txl_dist: Transformer-XL language models trained with DeepSpeed ZeRO at One-Billion-Word scale."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def load_pretrained(export_dir: Any, **overrides: Any) -> tuple[Any, Any]:
    """(model, tokenizer or None) of an export folder: see `txl_dist.export.load_pretrained`.

    Imported on first use, so that ``import txl_dist`` stays light (no torch).
    """
    from txl_dist.export import load_pretrained as _load_pretrained  # lazy: import txl_dist stays light (no torch)

    return _load_pretrained(export_dir, **overrides)


def generate(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 50, **sampling: Any) -> str:
    """Continue ``prompt``: see `txl_dist.inference.generate`."""
    from txl_dist.inference import generate as _generate  # lazy: import txl_dist stays light (no torch)

    return _generate(model, tokenizer, prompt, max_new_tokens, **sampling)


def score(model: Any, tokenizer: Any, texts: Any, **options: Any) -> list[dict[str, Any]]:
    """Log-probability and perplexity of each text: see `txl_dist.inference.score`."""
    from txl_dist.inference import score as _score  # lazy: import txl_dist stays light (no torch)

    return _score(model, tokenizer, texts, **options)
