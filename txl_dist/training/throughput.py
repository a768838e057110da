"""The log line's model FLOPs: FLOPs per token (`txl_dist.model.flops`), TFLOPS per rank and MFU.

MFU = TFLOPS per rank / the accelerator's peak for the run's matmul dtype. The peak is ``train.peak_tflops`` when
set, else the dense figure of the device's datasheet (`PEAK_TFLOPS`, matched on
``torch.cuda.get_device_name()``); where neither is known (a CPU) MFU is null and the log says why, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from txl_dist.config import RunConfig
from txl_dist.config.model import ModelConfig
from txl_dist.model import flops

# Dense peaks in TFLOPS per GPU (the datasheets' "with sparsity" figures halved), by the words of the device's
# name, most specific first. "fp32" is the CUDA cores' peak, "tf32" the tensor cores' for fp32 matmuls.
#   NVIDIA A100 Tensor Core GPU datasheet (SXM4 and PCIe, 40 and 80 GB).
#   NVIDIA H100 Tensor Core GPU datasheet (H100 SXM, H100 NVL; H100 PCIe from its product brief).
#   NVIDIA H200 Tensor Core GPU datasheet (H200 SXM, H200 NVL).
#   NVIDIA HGX B200 datasheet (per GPU).
PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("a100",), {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("h100", "pcie"), {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    (("h100", "nvl"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("h100",), {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (("h200", "nvl"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("h200",), {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    (("b200",), {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
)


def matmul_dtype(precision_dtype: str, device_type: str) -> str:
    """The dtype the run's matmuls use, as the peak table names it: fp32 runs on CUDA use tf32 tensor cores when
    torch allows them (``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision``)."""
    if precision_dtype == "fp32" and device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return precision_dtype


def known_peak(device_name: str, dtype: str) -> float | None:
    """The table's dense peak in TFLOPS of a device called ``device_name`` in ``dtype``, or None."""
    words = device_name.lower()
    for keys, peaks in PEAK_TFLOPS:
        if all(key in words for key in keys):
            return peaks.get(dtype)
    return None


@dataclasses.dataclass(frozen=True)
class FlopsMeter:
    """What turns a log window's tokens/s and targets into the three figures of the log line."""

    model: ModelConfig
    micro_batch: int
    world_size: int
    peak_tflops: float | None
    """Per rank, for the run's dtype; None where unknown (then `no_peak` says why)."""
    no_peak: str = ""

    @classmethod
    def of(cls, cfg: RunConfig, world_size: int, micro_batch: int, device: torch.device) -> FlopsMeter:
        dtype = matmul_dtype(cfg.precision.dtype, device.type)
        peak, no_peak = cfg.train.peak_tflops, ""
        if peak is None:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            peak = known_peak(name, dtype)
            if peak is None:
                no_peak = (
                    f"MFU is not logged: no {dtype} peak is known for the device ({name}; the table knows A100, "
                    "H100, H200, B200); set train.peak_tflops to the device's peak in TFLOPS to log it"
                )
        return cls(cfg.model, micro_batch, world_size, peak, no_peak)

    def terms(self, counts: Sequence[float]) -> dict[str, float]:
        """`flops.step_terms` of a micro-batch whose tail clusters hold the fractions of ``counts`` (targets per
        cluster, head first)."""
        return flops.step_terms(self.model, self.micro_batch, flops.tail_fractions(counts))

    def figures(self, counts: Sequence[float], tokens_per_s: float) -> dict[str, float | None]:
        """flops_per_token, tflops (per rank, from the global ``tokens_per_s``) and mfu (None without a peak)."""
        per_token = flops.flops_per_token(self.terms(counts), self.micro_batch, self.model.tgt_len)
        tflops = per_token * tokens_per_s / self.world_size / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops is not None else None
        return {"flops_per_token": per_token, "tflops": tflops, "mfu": mfu}

    def describe(self, counts: Sequence[float]) -> str:
        """The start line: FLOPs per token and its parts, from the tail fractions of ``counts``."""
        terms = self.terms(counts)
        tokens = self.micro_batch * self.model.tgt_len
        parts = flops.breakdown(terms)
        total = sum(parts.values())
        shares = ", ".join(f"{name} {value / tokens:.4g} ({100 * value / total:.1f}%)" for name, value in parts.items())
        fractions = ", ".join(f"{fraction:.3f}" for fraction in flops.tail_fractions(counts))
        clusters = f"; tail clusters' share of the targets {fractions} (first micro-batch)" if fractions else ""
        peak = f"{self.peak_tflops:g} TFLOPS peak per rank" if self.peak_tflops is not None else self.no_peak
        return (
            f"model FLOPs per token (forward + backward, docs/metrics.md): {total / tokens:.4g} = {shares}"
            f"{clusters}; {peak}"
        )
