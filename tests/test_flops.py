"""The model FLOPs formula (`txl_dist.model.flops`, docs/metrics.md) against what torch counts for a forward and a
backward of the real model (`torch.utils.flop_counter.FlopCounterMode`), and the peaks behind MFU
(`txl_dist.training.throughput`)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from txl_dist.config import load_config
from txl_dist.model import TransformerXLLM, flops, preset
from txl_dist.training.throughput import FlopsMeter, known_peak, matmul_dtype

TOLERANCE = 0.01
"""The issue asks for 10%; the formula counts what the model computes, so it agrees to rounding, and a tighter
bound also catches the small terms (the position projection, the zero row of BD)."""

BATCH = 3

CONFIGS = {
    "memory, adaptive, div_val 2": {},
    "no memory": {"mem_len": 0},
    "memory longer than the segment": {"mem_len": 12},
    "full softmax": {"cutoffs": []},
    "full softmax, no memory, d_embed != d_model": {"cutoffs": [], "mem_len": 0, "d_embed": 32},
    "div_val 1": {"div_val": 1},
    "div_val 1, projected": {"div_val": 1, "d_embed": 32},
    "div_val 4": {"div_val": 4, "d_embed": 64, "d_model": 32},
    "fused attention": {"attn_impl": "fused"},
    "pre-LN, untied biases": {"pre_lnorm": True, "untie_r": True},
}


def _counted(config, targets: torch.Tensor) -> tuple[float, int]:
    """FLOPs that torch counts for the forward and backward of a segment whose memory is full (the earlier
    segments' outputs, as in training), and the memory length it had."""
    torch.manual_seed(0)
    model = TransformerXLLM(config)
    tokens = torch.randint(0, config.n_token, targets.shape)
    mems = None
    for _ in range(-(-config.mem_len // config.tgt_len)):
        _, mems = model(tokens, targets, mems)
    with FlopCounterMode(display=False) as counter:
        loss, _ = model(tokens, targets, mems, cluster_rows=model.cluster_rows(targets))
        loss.mean().backward()
    return counter.get_total_flops(), 0 if mems is None else mems[0].shape[0]


def _formula(config, targets: torch.Tensor, mlen: int) -> float:
    fractions = flops.tail_fractions(flops.cluster_counts(targets, config.cutoffs).tolist())
    return sum(flops.step_terms(config, BATCH, fractions, mlen=mlen).values())


@pytest.mark.parametrize("name", CONFIGS)
def test_the_formula_counts_what_torch_counts_for_a_forward_and_backward(name):
    config = preset("tiny", **CONFIGS[name])
    targets = torch.randint(0, config.n_token, (BATCH, config.tgt_len), generator=torch.Generator().manual_seed(1))
    counted, mlen = _counted(config, targets)
    assert mlen == config.mem_len
    formula = _formula(config, targets, mlen)
    assert formula == pytest.approx(counted, rel=TOLERANCE), (name, formula / counted)
    if mlen:  # the memory's share is larger than the tolerance: leaving it out would fail
        assert _formula(config, targets, 0) < counted * (1 - 3 * TOLERANCE)


@pytest.mark.parametrize("where", ["head", "last tail cluster"])
def test_the_tail_clusters_count_by_the_rows_they_compute(where):
    """All targets in the head, or all in the largest cluster: the counts differ by far more than the tolerance,
    and the formula follows each (the tail clusters run only for their targets)."""
    config = preset("tiny", mem_len=0)
    low, high = (0, config.cutoffs[0]) if where == "head" else (config.cutoffs[-1], config.n_token)
    targets = torch.randint(low, high, (BATCH, config.tgt_len), generator=torch.Generator().manual_seed(2))
    counted, mlen = _counted(config, targets)
    assert _formula(config, targets, mlen) == pytest.approx(counted, rel=TOLERANCE)
    uniform = torch.randint(0, config.n_token, targets.shape, generator=torch.Generator().manual_seed(2))
    assert abs(_formula(config, uniform, mlen) / counted - 1) > 5 * TOLERANCE


def test_the_breakdown_adds_up_and_a_bigger_memory_costs_attention_only():
    config = preset("ptb_small")
    fractions = [0.1, 0.05]
    terms = flops.step_terms(config, 8, fractions)
    parts = flops.breakdown(terms)
    assert sum(parts.values()) == pytest.approx(sum(terms.values()))
    longer = flops.breakdown(flops.step_terms(config, 8, fractions, mlen=4 * config.mem_len))
    assert longer["attention"] > parts["attention"]
    assert {k: v for k, v in longer.items() if k != "attention"} == {k: v for k, v in parts.items() if k != "attention"}
    with pytest.raises(ValueError, match="one fraction per tail cluster"):
        flops.step_terms(config, 8, [0.1])


# ---- peaks and MFU -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device_name, dtype, peak",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "tf32", 156.0),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "fp16", 756.5),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA B200", "fp32", 75.0),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
        ("cpu", "fp32", None),
    ],
)
def test_the_peak_table_matches_the_device_name_most_specific_first(device_name, dtype, peak):
    assert known_peak(device_name, dtype) == peak


def test_fp32_counts_as_tf32_only_on_cuda_with_tf32_matmuls_allowed():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_dtype("fp32", "cuda") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert (matmul_dtype("fp32", "cuda"), matmul_dtype("fp32", "cpu")) == ("tf32", "fp32")
        assert matmul_dtype("bf16", "cuda") == "bf16"
    finally:
        torch.set_float32_matmul_precision(before)


def test_mfu_is_null_on_a_cpu_unless_train_peak_tflops_says_the_peak():
    cfg = load_config("configs/tiny_cpu.yaml", ["model.n_token=1000"])
    counts = [70, 20, 10]
    unknown = FlopsMeter.of(cfg, 2, 2, torch.device("cpu"))
    per_token = unknown.figures(counts, 1.0)["flops_per_token"]
    # The global rate at which each of 2 ranks does 1 TFLOPS of the model's work.
    tokens_per_s = 2 * 1e12 / per_token
    assert unknown.figures(counts, tokens_per_s) == pytest.approx(
        {"flops_per_token": per_token, "tflops": 1.0, "mfu": None}
    )
    assert "train.peak_tflops" in unknown.no_peak and "cpu" in unknown.no_peak
    assert "train.peak_tflops" in unknown.describe(counts)
    given = FlopsMeter.of(
        load_config("configs/tiny_cpu.yaml", ["model.n_token=1000", "train.peak_tflops=4"]), 2, 2, torch.device("cpu")
    )
    assert given.figures(counts, tokens_per_s)["mfu"] == pytest.approx(0.25) and not given.no_peak
