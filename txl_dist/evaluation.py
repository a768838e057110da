"""Perplexity over evaluation streams, on one process or across ranks (every target scored exactly once)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from sys import float_info

import torch
import torch.distributed as dist
from tqdm import tqdm

from txl_dist.model import TransformerXLLM
from txl_dist.model.recurrence import SegmentSettings


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device`` without making the host wait: on CUDA it is copied from pinned memory with
    ``non_blocking`` (the copy is queued behind the device's work instead of waiting for it)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def perplexity(loss: float) -> float:
    """exp(``loss``) of a mean loss in nats; ``inf`` where it overflows a float (a diverged model's), never an
    OverflowError."""
    return math.inf if loss >= math.log(float_info.max) else math.exp(loss)  # NaN stays NaN


@dataclass
class EvalResult:
    targets: int
    """Tokens scored (over all ranks)."""
    nll_sum: float
    """Summed negative log-likelihood in nats."""

    @property
    def loss(self) -> float:
        return self.nll_sum / self.targets

    @property
    def ppl(self) -> float:
        return perplexity(self.loss)


@torch.no_grad()
def evaluate(
    model: TransformerXLLM,
    streams,
    device: torch.device,
    *,
    max_batches: int = 0,
    progress: bool = False,
    segment: SegmentSettings | None = None,
) -> EvalResult:
    """Score `EvalStreams` with ``model`` in eval mode (the module itself; under DeepSpeed, ``engine.module``),
    with the segment settings ``segment`` (the model's own unless given).

    Every rank must call this with its own streams: all ranks run the same number of forwards (ZeRO-3 gathers
    parameters collectively), and the sums are all-reduced when a process group exists.
    """
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    mems = None
    total = streams.num_steps if not max_batches else min(max_batches, streams.num_steps)
    try:
        for index, batch in enumerate(tqdm(streams, total=total, disable=not progress, desc="eval", unit="batch")):
            if max_batches and index >= max_batches:
                break
            if batch.reset_mems:
                mems = None
            rows = model.cluster_rows(batch.targets, device)  # on the host: no wait for the device
            loss, mems = model(
                to_device(batch.inputs, device),
                to_device(batch.targets, device),
                mems,
                cluster_rows=rows,
                segment=segment,
            )
            mask = to_device(batch.mask, device)
            nll_sum += torch.where(mask, loss.double(), 0.0).sum()
            count += mask.sum()
    finally:
        model.train(was_training)
    if dist.is_available() and dist.is_initialized():
        totals = torch.stack([nll_sum, count])
        dist.all_reduce(totals)
        nll_sum, count = totals[0], totals[1]
    return EvalResult(targets=int(count.item()), nll_sum=float(nll_sum.item()))
