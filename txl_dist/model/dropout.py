"""Dropout that draws its CPU masks faster than ``torch.nn.Dropout`` (benchmarks/RESULTS.md has the figures).

On CPUs, ``F.dropout`` spends most of its time drawing one Bernoulli variable per element (and converting the
draw), a visible share of a small Transformer-XL's training step. Here the mask comes from
16 random bits per element, drawn 64 at a time: an element is kept when its 16 bits, read as a signed integer,
are at least ``round(p * 65536) - 32768``. The drop probability is therefore p rounded to a multiple of 1/65536
(0.1 -> 0.100006), and the draws come from torch's default CPU generator, so they follow ``torch.manual_seed`` and
are restored with the RNG state like any other. The mask is written straight into the input's dtype (a
comparison with a float output), and input and gradient are scaled by one fused multiply each.

Elsewhere (CUDA's generator is already fast, and under ``torch.compile``, which fuses its own) this is
``F.dropout``. Drop-in for ``nn.Dropout``: same attribute ``p``, no parameters, no state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _keep_mask(like: torch.Tensor, p: float) -> torch.Tensor:
    """1.0 with probability 1 - p (p in steps of 1/65536), else 0.0; the shape and dtype of ``like``."""
    count = like.numel()
    words = torch.randint(-(2**63), 2**63 - 1, ((count + 3) // 4,), dtype=torch.int64)
    threshold = round(p * 65536) - 32768
    bits = words.view(torch.int16)[:count].view(like.shape)
    return torch.ge(bits, threshold, out=torch.empty(like.shape, dtype=like.dtype))


class _ScaleByMask(torch.autograd.Function):
    """x * keep / (1 - p), and the same for the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.addcmul(x.new_zeros(()), x, keep, value=scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return torch.addcmul(grad.new_zeros(()), grad, keep, value=ctx.scale), None, None


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout(x, p, training)``, with the faster mask on CPU (see the module docstring)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0 or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    return _ScaleByMask.apply(x, _keep_mask(x, p), 1.0 / (1.0 - p))


class Dropout(nn.Module):
    """``nn.Dropout`` with the faster CPU mask of `dropout`."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability p={p} is not in [0, 1]")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
