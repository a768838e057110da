"""The settings of segment-level recurrence: segment and memory lengths, attention span, the memory's dtype.

`SegmentSettings` is what training, evaluation and decoding may choose differently for the same weights: a model
takes its own from its config, and evaluation or decoding pass other settings in (the config is never changed).
"""

from __future__ import annotations

import dataclasses

import torch

from txl_dist.config.model import MEM_DTYPE_NAMES, ModelConfig, same_length_problem

MEM_DTYPES: dict[str, torch.dtype | None] = dict(
    zip(MEM_DTYPE_NAMES, (None, torch.float32, torch.bfloat16, torch.float16), strict=True)
)
"""``model.mem_dtype`` -> the dtype the memory is stored in; None: that of the hidden states."""


@dataclasses.dataclass(frozen=True)
class SegmentSettings:
    """How a model reads a stream: in segments of ``tgt_len`` tokens, each attending to a memory of the newest
    ``mem_len`` positions before it; relative distances beyond ``clamp_len`` (when > 0) share one encoding; with
    ``same_length`` every query sees the same number of keys."""

    tgt_len: int
    mem_len: int
    clamp_len: int
    same_length: bool

    def __post_init__(self) -> None:
        if self.tgt_len < 1:
            raise ValueError(f"tgt_len={self.tgt_len} is not allowed: a positive integer")
        if self.mem_len < 0:
            raise ValueError(f"mem_len={self.mem_len} is not allowed: an integer >= 0")
        problem = same_length_problem(self.same_length, self.mem_len)
        if problem:
            raise ValueError(f"same_length={self.same_length} is not allowed: {problem}")

    @classmethod
    def of(cls, config: ModelConfig) -> SegmentSettings:
        """The settings a model's config trains with."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})
