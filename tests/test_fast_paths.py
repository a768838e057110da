"""The fast paths keep the model's results: half-precision attention, the CPU dropout, the key/value cache for
generation, and torch.compile. (The paper-exact oracles for the attention itself are in test_model.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.recompute import generate_ids_recompute
from txl_dist.inference import IncrementalDecoder, generate_ids
from txl_dist.model import TransformerXLLM, preset
from txl_dist.model.dropout import Dropout, dropout


def _segments(config, n_segments=3, batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.n_token, (batch, n_segments * config.tgt_len + 1), generator=g)
    return [
        (
            data[:, s * config.tgt_len : (s + 1) * config.tgt_len],
            data[:, s * config.tgt_len + 1 : (s + 1) * config.tgt_len + 1],
        )
        for s in range(n_segments)
    ]


def _sensitive_model(config) -> TransformerXLLM:
    """A model in eval mode whose outputs depend visibly on the context: the initial weights (std 0.02) make
    attention almost uniform and the memory's effect tiny, so every weight gets noise of std 0.3."""
    torch.manual_seed(0)
    model = TransformerXLLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


class _DtypeRecorder(TorchDispatchMode):
    """The input dtypes of the attention matmuls and of the softmax, as dispatched."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in (
            "bmm",
            "baddbmm",
            "_softmax",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_attention_math",
            "_scaled_dot_product_efficient_attention",
        ):
            self.seen.setdefault(name, set()).add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_half_precision_attention_runs_its_matmuls_in_bf16_close_to_fp32(impl):
    """Under bf16 autocast the reference attention's matmuls take bf16 inputs (tensor cores) while the softmax
    normalises in fp32; both paths' losses and gradients stay within bf16 tolerance of fp32. (On CPUs the fused
    path falls back to PyTorch's math kernel, which upcasts; the kernels it reaches on CUDA, with bf16 inputs,
    are checked by benchmarks/gpu_check.py.)"""
    config = preset("tiny", attn_impl=impl, n_head=4, d_head=16, d_model=32, d_embed=32, mem_len=8, tgt_len=8)
    torch.manual_seed(0)
    fp32 = TransformerXLLM(config)
    bf16 = TransformerXLLM(config)
    bf16.load_state_dict(fp32.state_dict())
    mems32 = mems16 = None
    for inputs, targets in _segments(config):
        loss32, mems32 = fp32(inputs, targets, mems32)
        with torch.autocast("cpu", dtype=torch.bfloat16), _DtypeRecorder() as recorder:
            loss16, mems16 = bf16(inputs, targets, mems16)
        assert loss16.dtype == torch.float32
        assert torch.allclose(loss16, loss32, rtol=2e-2, atol=2e-2), (loss16 - loss32).abs().max()
        if impl == "reference":
            assert recorder.seen["bmm"] == {torch.bfloat16} and recorder.seen["baddbmm"] == {torch.bfloat16}
            assert recorder.seen["_softmax"] == {torch.float32}
        loss32.mean().backward()
        loss16.mean().backward()
    for (name, p32), p16 in zip(fp32.named_parameters(), bf16.parameters()):
        scale = p32.grad.abs().max().clamp_min(1e-6)
        assert ((p16.grad - p32.grad).abs().max() / scale) < 0.1, name


def test_cpu_dropout_keeps_one_minus_p_scales_and_follows_the_seed():
    x = torch.ones(400_000, requires_grad=True)
    torch.manual_seed(3)
    out = dropout(x, 0.3, training=True)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.005
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.7))
    out.backward(torch.full_like(out, 2.0))
    assert torch.equal(x.grad != 0, kept) and torch.allclose(x.grad[kept], torch.full_like(out[kept], 2 / 0.7))
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.3, training=True), out)  # the global generator's state decides the mask
    assert dropout(x, 0.3, training=False) is x and dropout(x, 0.0, training=True) is x
    module = Dropout(0.3).eval()
    assert module(x) is x and "p=0.3" in repr(module)
    with pytest.raises(ValueError, match="p=1.5"):
        Dropout(1.5)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # ptb-like
        dict(same_length=True, clamp_len=5),  # the paper's evaluation settings
        dict(mem_dtype="bfloat16", pre_lnorm=True),  # memory stored in bf16
        dict(untie_r=True, mem_len=4),  # a memory shorter than the prompt
    ],
)
def test_kv_cache_gives_the_memory_paths_log_probs_and_tokens(overrides):
    config = preset("tiny", **{"dropout": 0.0, "dropatt": 0.0, "mem_len": 40, "tgt_len": 8, **overrides})
    model = _sensitive_model(config)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, config.n_token, (21,), generator=g).tolist()
    cached, memory = IncrementalDecoder(model, kv_cache=True), IncrementalDecoder(model, kv_cache=False)
    with torch.no_grad():
        steps = [prompt] + [[t] for t in torch.randint(0, config.n_token, (30,), generator=g).tolist()]
        for ids in steps:
            assert torch.allclose(cached.feed(ids), memory.feed(ids), atol=1e-5)
    assert cached.cache.mlen == min(config.mem_len, len(prompt) + 30)
    for kwargs in (dict(greedy=True), dict(seed=7, top_k=50), dict(seed=11, top_p=0.9, temperature=0.8)):
        with_cache = generate_ids(model, prompt, 60, **kwargs)
        assert with_cache == generate_ids(model, prompt, 60, kv_cache=False, **kwargs)
        assert len(with_cache) == 60


def test_kv_cache_with_a_memory_covering_the_context_equals_recomputation():
    config = preset("tiny", dropout=0.0, dropatt=0.0, mem_len=128, tgt_len=8)
    model = _sensitive_model(config)
    prompt = torch.randint(0, config.n_token, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert generate_ids(model, prompt, 40, greedy=True) == generate_ids_recompute(model, prompt, 40, greedy=True)


def test_a_wrong_kv_cache_changes_the_log_probs():
    """The memory matters to the cached decoder: dropping the cache's memory gives other log-probabilities."""
    config = preset("tiny", dropout=0.0, dropatt=0.0, mem_len=40, tgt_len=8)
    model = _sensitive_model(config)
    prompt = list(range(1, 20))
    decoder = IncrementalDecoder(model)
    with torch.no_grad():
        decoder.feed(prompt)
        reference = IncrementalDecoder(model)
        reference.feed(prompt)
        decoder.cache.mlen = 0  # forget the memory
        assert not torch.allclose(decoder.feed([5]), reference.feed([5]), atol=1e-3)


def test_compiled_body_gives_eager_losses_and_gradients():
    config = preset("tiny", dropout=0.0, dropatt=0.0)
    torch.manual_seed(0)
    eager = TransformerXLLM(config)
    compiled = TransformerXLLM(dataclasses.replace(config, compile=True))
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_body()
    mems_e = mems_c = None
    for inputs, targets in _segments(config):
        loss_e, mems_e = eager(inputs, targets, mems_e)
        loss_c, mems_c = compiled(inputs, targets, mems_c, cluster_rows=compiled.cluster_rows(targets))
        assert torch.allclose(loss_c, loss_e, atol=1e-5)
        loss_e.mean().backward()
        loss_c.mean().backward()
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no "_orig_mod." keys
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert b.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-6), name
