"""The model against the paper, against itself (fused vs reference, recurrence), and against HuggingFace."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from txl_dist.model import ModelConfig, TransformerXLLM, adaptive, preset
from txl_dist.model.adaptive import ProjectedAdaptiveLogSoftmax
from txl_dist.model.attention import (
    RelPartialLearnableMultiHeadAttn,
    attention_mask,
    relative_positions,
    sinusoid_encoding,
)

# ---------------------------------------------------------------------------------------------------------------
# 1. The attention equals the paper's four terms written out position by position.


def _paper_sinusoid(distance: float, d_model: int) -> torch.Tensor:
    """R_distance as in the authors' code: [sin(d / 10000^(2k/d_model)) for k] + [cos(...) for k]."""
    half = d_model // 2
    freqs = [1.0 / 10000 ** (2 * k / d_model) for k in range(half)]
    return torch.tensor(
        [math.sin(distance * f) for f in freqs] + [math.cos(distance * f) for f in freqs], dtype=torch.float64
    )


def _naive_attention(attn, w, mem, u, v, mem_len, clamp_len, same_length):
    """score(i, j) = (a) q_i.k_j + (b) q_i.W_R R_{i-j} + (c) u.k_j + (d) v.W_R R_{i-j}, one pair at a time."""
    n_head, d_head = attn.n_head, attn.d_head
    qlen, bsz, d_model = w.shape
    cat = torch.cat([mem, w], 0) if mem is not None else w
    mlen = cat.shape[0] - qlen
    w_q, w_k, w_v = attn.qkv_net.weight.detach().chunk(3, dim=0)
    w_r = attn.r_net.weight.detach()
    out = torch.zeros(qlen, bsz, n_head * d_head, dtype=torch.float64)
    for b in range(bsz):
        for h in range(n_head):
            rows = slice(h * d_head, (h + 1) * d_head)
            for i in range(qlen):
                q_i = w_q[rows] @ cat[mlen + i, b]
                scores, values = [], []
                for j in range(cat.shape[0]):
                    distance = mlen + i - j
                    if distance < 0 or (same_length and distance >= mem_len):
                        continue
                    k_j = w_k[rows] @ cat[j, b]
                    encoded = distance if clamp_len <= 0 else min(distance, clamp_len)
                    r_ij = w_r[rows] @ _paper_sinusoid(encoded, d_model)
                    term_a = q_i @ k_j
                    term_b = q_i @ r_ij
                    term_c = u[h] @ k_j
                    term_d = v[h] @ r_ij
                    scores.append((term_a + term_b + term_c + term_d) / math.sqrt(d_head))
                    values.append(w_v[rows] @ cat[j, b])
                prob = torch.softmax(torch.stack(scores), dim=0)
                out[i, b, rows] = sum(p * val for p, val in zip(prob, values))
    attn_out = out @ attn.o_net.weight.detach().t()
    ln = attn.layer_norm
    return F.layer_norm(w + attn_out, (d_model,), ln.weight.detach(), ln.bias.detach(), ln.eps)


def _random_attention(impl: str, d_model=8, n_head=2, d_head=3, seed=0):
    torch.manual_seed(seed)
    attn = RelPartialLearnableMultiHeadAttn(
        n_head,
        d_model,
        d_head,
        dropout=0.0,
        dropatt=0.0,
        pre_lnorm=False,
        layer_norm_eps=1e-5,
        attn_impl=impl,
        own_position_biases=False,
    )
    attn = attn.double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.5)
    u, v = torch.randn(n_head, d_head, dtype=torch.float64), torch.randn(n_head, d_head, dtype=torch.float64)
    return attn, u, v


@pytest.mark.parametrize("impl", ["reference", "fused"])
@pytest.mark.parametrize("mlen", [0, 4])
@pytest.mark.parametrize("clamp_len", [-1, 3])
@pytest.mark.parametrize("same_length", [False, True])
def test_attention_equals_the_four_terms_of_the_paper(impl, mlen, clamp_len, same_length):
    attn, u, v = _random_attention(impl)
    qlen, bsz, mem_len = 5, 2, 4
    w = torch.randn(qlen, bsz, attn.d_model, dtype=torch.float64)
    mem = torch.randn(mlen, bsz, attn.d_model, dtype=torch.float64) if mlen else None
    klen = mlen + qlen
    r = sinusoid_encoding(relative_positions(klen, clamp_len, w.device), attn.d_model, torch.float64)
    mask = attention_mask(qlen, mlen, mem_len, same_length, w.device)
    got = attn(w, r, mask, mem, u, v)
    want = _naive_attention(attn, w, mem, u, v, mem_len, clamp_len, same_length)
    assert (got - want).abs().max().item() <= 1e-10


def test_same_length_gives_every_query_mem_len_keys():
    mask = attention_mask(qlen=6, mlen=4, mem_len=4, same_length=True, device=torch.device("cpu"))
    assert (~mask).sum(dim=1).tolist() == [4] * 6
    first_segment = attention_mask(qlen=6, mlen=0, mem_len=4, same_length=True, device=torch.device("cpu"))
    assert (~first_segment).sum(dim=1).tolist() == [1, 2, 3, 4, 4, 4]


@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_fully_masked_rows_give_zeros_not_nan(impl):
    attn, u, v = _random_attention(impl)
    w = torch.randn(3, 2, attn.d_model, dtype=torch.float64)
    r = sinusoid_encoding(relative_positions(3, -1, w.device), attn.d_model, torch.float64)
    mask = attention_mask(3, 0, 3, False, w.device).clone()
    mask[1] = True  # query 1 may attend to nothing
    with torch.no_grad():
        out = attn(w, r, mask, None, u, v)
        # With no attention output the sub-layer is layer_norm(w + 0).
        ln = attn.layer_norm
        expected_row = F.layer_norm(w[1], (attn.d_model,), ln.weight, ln.bias, ln.eps)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[1], expected_row, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# 2. Fused path equals the reference path.


def _pair(config: ModelConfig):
    torch.manual_seed(0)
    reference = TransformerXLLM(dataclasses.replace(config, attn_impl="reference")).eval()
    fused = TransformerXLLM(dataclasses.replace(config, attn_impl="fused")).eval()
    fused.load_state_dict(reference.state_dict())
    return reference, fused


def _segments(config: ModelConfig, n_segments=3, batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.n_token, (batch, n_segments * config.tgt_len + 1), generator=g)
    return [
        (
            data[:, s * config.tgt_len : (s + 1) * config.tgt_len],
            data[:, s * config.tgt_len + 1 : (s + 1) * config.tgt_len + 1],
        )
        for s in range(n_segments)
    ]


@pytest.mark.parametrize("same_length", [False, True])
def test_fused_equals_reference_fp32(same_length):
    config = preset("tiny", mem_len=6, clamp_len=5, same_length=same_length)
    reference, fused = _pair(config)
    mems_r = mems_f = None
    for inputs, targets in _segments(config):
        loss_r, mems_r = reference(inputs, targets, mems_r)
        loss_f, mems_f = fused(inputs, targets, mems_f)
        assert (loss_r - loss_f).abs().max().item() <= 1e-5
        for a, b in zip(mems_r, mems_f):
            assert (a - b).abs().max().item() <= 1e-5


def test_fused_equals_reference_bf16_autocast():
    config = preset("tiny", mem_len=8)
    reference, fused = _pair(config)
    mems_r = mems_f = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for inputs, targets in _segments(config):
            loss_r, mems_r = reference(inputs, targets, mems_r)
            loss_f, mems_f = fused(inputs, targets, mems_f)
            assert loss_r.dtype == torch.float32
            # bf16 keeps ~3 significant digits; both paths share the bf16 projections.
            assert torch.allclose(loss_r, loss_f, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------------
# 3. Segment recurrence.


@pytest.mark.parametrize("mem_len", [8, 12])
def test_recurrence_equals_one_long_forward(mem_len):
    config = preset("tiny", tgt_len=8, mem_len=mem_len)  # mem_len >= tgt_len: segment 2 sees all of segment 1
    torch.manual_seed(0)
    model = TransformerXLLM(config).eval()
    (x1, y1), (x2, y2) = _segments(config, n_segments=2)
    with torch.no_grad():
        _, mems = model(x1, y1)
        loss2, _ = model(x2, y2, mems)
        hidden2, _ = model.hidden_states(x2, mems)
        long_model = TransformerXLLM(dataclasses.replace(config, tgt_len=16)).eval()
        long_model.load_state_dict(model.state_dict())
        loss_long, _ = long_model(torch.cat([x1, x2], 1), torch.cat([y1, y2], 1))
        hidden_long, _ = long_model.hidden_states(torch.cat([x1, x2], 1))
    assert (loss2 - loss_long[:, 8:]).abs().max().item() <= 1e-5
    assert (hidden2 - hidden_long[8:]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mem_len", [0, 5, 8, 20])
def test_mems_hold_exactly_the_newest_positions(mem_len):
    config = preset("tiny", tgt_len=8, mem_len=mem_len)
    torch.manual_seed(0)
    model = TransformerXLLM(config).eval()
    segments = _segments(config, n_segments=3)
    mems = None
    with torch.no_grad():
        for step, (x, y) in enumerate(segments, start=1):
            _, mems = model(x, y, mems)
            assert len(mems) == config.n_layer + 1
            for mem in mems:
                assert mem.shape == (min(mem_len, 8 * step), 3, config.d_model)
                assert not mem.requires_grad
    # Content: a model that keeps everything has the same states; the memory is their newest mem_len positions
    # (checked on one 24-token segment, shorter and longer than the memory).
    x = torch.cat([s[0] for s in segments], 1)
    short = TransformerXLLM(dataclasses.replace(config, tgt_len=24)).eval()
    short.load_state_dict(model.state_dict())
    full = TransformerXLLM(dataclasses.replace(config, tgt_len=24, mem_len=24)).eval()
    full.load_state_dict(model.state_dict())
    with torch.no_grad():
        _, kept = short.hidden_states(x)
        _, everything = full.hidden_states(x)
    for a, b in zip(kept, everything):
        assert a.shape[0] == min(mem_len, 24)
        assert torch.equal(a, b[b.shape[0] - a.shape[0] :])


def test_mem_dtype_is_configurable():
    config = preset("tiny", mem_dtype="bfloat16")
    model = TransformerXLLM(config).eval()
    ((x, y),) = _segments(config, n_segments=1)
    _, mems = model(x, y)
    assert all(m.dtype == torch.bfloat16 for m in mems)
    loss, mems = model(x, y, mems)  # bf16 memory feeds an fp32 model
    assert torch.isfinite(loss).all() and mems[0].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
# 4. Adaptive softmax.


@pytest.mark.parametrize(
    "cutoffs,div_val,d_embed", [([], 1, 16), ([100], 1, 12), ([100, 300], 2, 16), ([50, 200, 600], 4, 64)]
)
def test_adaptive_log_probs_sum_to_one_and_match_the_loss(cutoffs, div_val, d_embed):
    torch.manual_seed(0)
    crit = ProjectedAdaptiveLogSoftmax(1000, d_embed, 16, cutoffs, div_val)
    for p in crit.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    hidden = torch.randn(50, 16)
    target = torch.randint(0, 1000, (50,))
    target[:4] = torch.tensor([0, 999, cutoffs[0] if cutoffs else 1, 57])
    log_probs = crit.log_prob(hidden)
    assert log_probs.shape == (50, 1000)
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(50), atol=1e-5)
    nll = crit(hidden, target)
    assert torch.allclose(nll, -log_probs.gather(1, target[:, None]).squeeze(1), atol=1e-5)


@pytest.mark.parametrize("cutoffs,div_val,d_embed", [([], 1, 16), ([100, 300], 1, 16), ([50, 200, 600], 4, 64)])
@pytest.mark.parametrize("cluster_bias", [-20.0, 4.0, 8.0])
def test_adaptive_argmax_equals_the_full_argmax_and_skips_clusters_that_cannot_win(
    cutoffs, div_val, d_embed, cluster_bias, monkeypatch
):
    """Greedy decoding's exact argmax: the lowest id of the maximum of `log_prob`, for rows whose winner lies in
    the head or in a tail; a cluster whose head log-probability is below the best word is never computed."""
    torch.manual_seed(0)
    crit = ProjectedAdaptiveLogSoftmax(1000, d_embed, 16, cutoffs, div_val)
    for p in crit.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    hidden = torch.randn(64, 16)
    if cutoffs:
        with torch.no_grad():
            crit.cluster_bias.fill_(cluster_bias)
    computed = []
    original = ProjectedAdaptiveLogSoftmax._cluster_logits
    monkeypatch.setattr(
        ProjectedAdaptiveLogSoftmax,
        "_cluster_logits",
        lambda self, h, i, *w: computed.append((i, h.shape[0])) or original(self, h, i, *w),
    )
    chosen = crit.argmax(hidden)
    tails = {i for i, _ in computed if i > 0}
    computed.clear()
    expected = crit.log_prob(hidden).argmax(dim=-1)
    assert torch.equal(chosen, expected)
    in_tail = int((expected >= (cutoffs[0] if cutoffs else 1000)).sum())
    if cluster_bias == -20.0 and cutoffs:
        assert in_tail == 0 and not tails  # no cluster can win: none is computed
    if cutoffs and cluster_bias == 4.0:
        assert in_tail >= 1 and tails  # a few rows have their winner in a tail, and it was computed
    if cutoffs and cluster_bias == 8.0:
        assert in_tail > 10  # the tails hold many winners, and they were found
    # Equal words: the lower id, as argmax gives it.
    with torch.no_grad():
        layer = crit.out_layers[0]
        layer.weight[7] = layer.weight[5]
        layer.bias[5] = layer.bias[7] = 50.0
    assert (crit.argmax(hidden) == 5).all() and (crit.log_prob(hidden).argmax(dim=-1) == 5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_picked_nll_equals_the_composed_log_softmax_in_value_and_gradient(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(37, 501) * 4).to(dtype)
    index = torch.randint(0, 501, (37,))
    index[:3] = torch.tensor([0, 500, 0])
    weights = torch.rand(37) + 0.5  # a different upstream gradient per row, one of them zero
    weights[5] = 0.0

    def run(nll_of):
        x = logits.clone().requires_grad_()
        nll = nll_of(x)
        (nll * weights).sum().backward()
        return nll.detach(), x.grad

    nll, grad = run(lambda x: adaptive.picked_nll(x, index))
    expected_nll, expected_grad = run(lambda x: -torch.log_softmax(x.float(), -1).gather(1, index[:, None])[:, 0])
    assert nll.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(nll, expected_nll)
    tolerance = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    assert torch.allclose(grad.float(), expected_grad.float(), **tolerance)
    assert (grad[5] == 0).all()
    empty = torch.zeros(0, 8, dtype=dtype, requires_grad=True)  # a tail cluster without rows this step
    adaptive.picked_nll(empty, torch.zeros(0, dtype=torch.long)).sum().backward()
    assert empty.grad.shape == (0, 8)


def test_padded_tail_rows_keep_few_shapes_and_add_at_most_an_eighth():
    lengths = set()
    for n in range(0, 5000):
        rows = torch.arange(n) + 7
        padded = adaptive._padded(rows)
        assert torch.equal(padded[:n], rows) and (padded[n:] == 7).all()
        assert n <= padded.shape[0] <= max(n, n * 9 // 8 + 1)
        lengths.add(padded.shape[0])
    assert len(lengths) < 17 + 8 * 9  # up to 16 exact, then 8 per octave


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_tail_rows_padded_on_cpu_give_the_unpadded_losses_and_gradients(autocast, monkeypatch):
    """The padding rows are computed and dropped: losses and gradients are those of the unpadded clusters."""
    torch.manual_seed(0)
    crit = ProjectedAdaptiveLogSoftmax(1000, 32, 32, [100, 300], 1)
    for p in crit.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    if not autocast:
        crit = crit.to(torch.bfloat16)
    hidden = torch.randn(300, 32, dtype=torch.float32 if autocast else torch.bfloat16)
    target = torch.randint(0, 1000, (300,))  # about 210 rows in the last cluster: padded to 224

    def run(pads: bool):
        monkeypatch.setattr(adaptive, "_pads_rows", lambda h: pads)
        h = hidden.clone().requires_grad_()
        crit.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = crit(h, target)
        loss.sum().backward()
        return loss.detach(), h.grad, crit.out_layers[0].weight.grad.clone()

    monkeypatch.undo()
    assert adaptive._pads_rows(hidden.to(torch.bfloat16)) and not adaptive._pads_rows(hidden.float())
    padded, unpadded = run(True), run(False)
    assert adaptive._padded(crit.cluster_rows(target).rows[1]).shape[0] > crit.cluster_rows(target).rows[1].shape[0]
    for a, b in zip(padded, unpadded):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_full_softmax_without_cutoffs():
    torch.manual_seed(0)
    crit = ProjectedAdaptiveLogSoftmax(300, 8, 12, [], 1)
    for p in crit.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    hidden = torch.randn(20, 12)
    weight, bias, proj = crit.out_layers[0].weight, crit.out_layers[0].bias, crit.out_projs[0]
    expected = torch.log_softmax((hidden @ proj) @ weight.t() + bias, dim=-1)
    assert torch.allclose(crit.log_prob(hidden), expected, atol=1e-6)


@pytest.mark.parametrize("div_val,d_embed", [(1, 16), (1, 8), (2, 16)])
def test_tied_parameters_share_storage(div_val, d_embed):
    config = preset("tiny", div_val=div_val, d_embed=d_embed)
    model = TransformerXLLM(config)
    for out_layer, emb_layer in zip(model.crit.out_layers, model.word_emb.emb_layers):
        assert out_layer.weight is emb_layer.weight
    for i, tied in enumerate(config.tie_projs_resolved):
        proj = model.crit.out_projs[i]
        if proj is None:
            continue
        emb_proj = model.word_emb.emb_projs[0 if div_val == 1 else i]
        assert (proj.data_ptr() == emb_proj.data_ptr()) == tied
    names = [n for n, _ in model.named_parameters()]
    assert not any(n.startswith("crit.out_layers") and n.endswith("weight") for n in names)
    # A tied parameter is one parameter: its gradient collects both uses. The same weights in an untied model
    # give each use its own gradient; the tied gradient is their sum.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    untied = TransformerXLLM(
        dataclasses.replace(config, tie_weight=False, tie_projs=[False] * len(config.tie_projs_resolved))
    )
    untied.load_state_dict(model.state_dict(), strict=True)
    ((x, y),) = _segments(config, n_segments=1)
    model(x, y)[0].mean().backward()
    untied(x, y)[0].mean().backward()
    # shared parameter -> (its use as an input embedding or projection, its uses in the softmax), in the untied model
    uses = {
        id(model.word_emb.emb_layers[i].weight): (
            model.word_emb.emb_layers[i].weight,
            untied.word_emb.emb_layers[i].weight,
            [untied.crit.out_layers[i].weight],
        )
        for i in range(len(model.word_emb.emb_layers))
    }
    for i, tied in enumerate(config.tie_projs_resolved):
        if tied and model.crit.out_projs[i] is not None:
            emb = 0 if div_val == 1 else i  # with div_val 1, every tied cluster shares the one input projection
            shared = model.word_emb.emb_projs[emb]
            uses.setdefault(id(shared), (shared, untied.word_emb.emb_projs[emb], []))[2].append(
                untied.crit.out_projs[i]
            )
    assert len(uses) > len(model.word_emb.emb_layers) or not any(
        tied and p is not None for tied, p in zip(config.tie_projs_resolved, model.crit.out_projs)
    )
    for shared, as_input, as_outputs in uses.values():
        assert as_input.grad.abs().max() > 0 and all(p.grad.abs().max() > 0 for p in as_outputs)
        torch.testing.assert_close(shared.grad, as_input.grad + sum(p.grad for p in as_outputs), rtol=1e-5, atol=1e-7)


def test_untied_weights_are_separate():
    model = TransformerXLLM(preset("tiny", tie_weight=False, tie_projs=[False, False, False]))
    assert model.crit.out_layers[0].weight is not model.word_emb.emb_layers[0].weight
    assert model.crit.out_projs[1] is not model.word_emb.emb_projs[1]


def test_initialisation_follows_the_authors():
    torch.manual_seed(0)
    model = TransformerXLLM(preset("ptb_small"))
    qkv = model.layers[0].dec_attn.qkv_net.weight
    assert abs(qkv.std().item() - 0.02) < 0.002
    assert abs(model.layers[0].pos_ff.layer_norm.weight.mean().item() - 1.0) < 0.01
    assert model.layers[0].pos_ff.CoreNet[0].bias.abs().max().item() == 0.0
    assert model.crit.cluster_bias.abs().max().item() == 0.0
    # ptb_small (div_val 1, d_embed = d_model) has no projection at all; with div_val 2 every cluster has one,
    # drawn from N(0, proj_init_std), not from the weights' N(0, init_std).
    assert all(p is None for p in model.crit.out_projs) and all(p is None for p in model.word_emb.emb_projs)
    projected = TransformerXLLM(preset("ptb_small", div_val=2))
    projections = [p for p in list(projected.word_emb.emb_projs) + list(projected.crit.out_projs) if p is not None]
    assert len(projections) == 6  # 3 clusters, tied in pairs except the head's
    for projection in projections:
        assert abs(projection.std().item() - 0.01) < 0.001 and abs(projection.mean().item()) < 0.001


# ---------------------------------------------------------------------------------------------------------------
# 5. The same weights in HuggingFace transformers 4.37.2 give the same losses.

HF_CASES = {
    "div_val1_projected_tied": dict(div_val=1, d_embed=12, cutoffs=[200, 600]),
    "div_val1_projected_untied": dict(div_val=1, d_embed=12, cutoffs=[200, 600], tie_projs=[False, False, False]),
    "div_val4_tied_projs": dict(div_val=4, d_embed=32, cutoffs=[200, 600]),
    "div_val4_untied_projs": dict(div_val=4, d_embed=32, cutoffs=[200, 600], tie_projs=[False, False, False]),
    "untie_r": dict(div_val=4, d_embed=32, cutoffs=[200, 600], untie_r=True),
    "untie_r_pre_lnorm_clamp_same_length": dict(
        div_val=2, d_embed=16, cutoffs=[300], untie_r=True, pre_lnorm=True, clamp_len=5, same_length=True
    ),
    "full_softmax_untied_weights": dict(div_val=1, d_embed=16, cutoffs=[], tie_weight=False),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_huggingface_gives_the_same_losses(case):
    import transformers
    from transformers.models.deprecated.transfo_xl import TransfoXLConfig, TransfoXLLMHeadModel

    from txl_dist.convert.hf import from_hf_state_dict, to_hf_config, to_hf_state_dict

    assert transformers.__version__ == "4.37.2"
    config = preset("tiny", n_layer=3, mem_len=6, tgt_len=5, **HF_CASES[case])
    torch.manual_seed(0)
    ours = TransformerXLLM(config).eval()
    with torch.no_grad():  # move every weight away from its initial value so that a wrong map shows
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = TransfoXLLMHeadModel(TransfoXLConfig(**to_hf_config(config))).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), config), strict=True)
    # Without keep_order HuggingFace returns the losses grouped by cluster, not in token order.
    hf.crit.keep_order = True

    mems = None
    hf_mems = [torch.empty(0, 3, config.d_model)] * config.n_layer
    for inputs, targets in _segments(config, n_segments=3):
        with torch.no_grad():
            loss, mems = ours(inputs, targets, mems)
            # HuggingFace shifts labels inside: position t is scored against labels[t + 1].
            labels = torch.cat([torch.zeros_like(targets[:, :1]), targets], 1)[:, :-1]
            out = hf(input_ids=inputs, labels=labels, mems=hf_mems)
            hf_mems = out.mems
        assert (loss[:, :-1] - out.losses).abs().max().item() <= 1e-5
        assert len(mems) == len(hf_mems) + 1
        for a, b in zip(mems, hf_mems):
            assert (a - b).abs().max().item() <= 1e-5
    # And the map back is exact.
    back = from_hf_state_dict(hf.state_dict(), config)
    ours_state = ours.state_dict()
    assert sorted(back) == sorted(ours_state)
    assert all(torch.equal(back[k], ours_state[k]) for k in back)


def test_huggingface_full_vocabulary_log_probs_match():
    from transformers.models.deprecated.transfo_xl import TransfoXLConfig, TransfoXLLMHeadModel

    from txl_dist.convert.hf import to_hf_config, to_hf_state_dict

    config = preset("tiny", n_layer=2, mem_len=5, tgt_len=5, div_val=2, d_embed=16, cutoffs=[200, 600])
    torch.manual_seed(0)
    ours = TransformerXLLM(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = TransfoXLLMHeadModel(TransfoXLConfig(**to_hf_config(config))).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), config), strict=True)
    ((inputs, _),) = _segments(config, n_segments=1)
    with torch.no_grad():
        log_probs, _ = ours(inputs)
        hf_scores = hf(input_ids=inputs, mems=[torch.empty(0, 3, config.d_model)] * config.n_layer).prediction_scores
    assert (log_probs - hf_scores).abs().max().item() <= 1e-5


def test_untranslatable_tie_projs_is_refused():
    from txl_dist.convert.hf import to_hf_config

    with pytest.raises(ValueError, match="tie_projs"):
        to_hf_config(preset("tiny", tie_projs=[True, False, True]))


# ---------------------------------------------------------------------------------------------------------------
# 6. Mixed precision.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_forward_backward_close_to_fp32(dtype):
    config = preset("tiny", n_layer=2, mem_len=8)
    torch.manual_seed(0)
    model = TransformerXLLM(config)
    segments = _segments(config, n_segments=2)

    def run(autocast_dtype):
        model.zero_grad()
        mems, total = None, 0.0
        for inputs, targets in segments:
            with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss, mems = model(inputs, targets, mems)
            assert loss.dtype == torch.float32
            loss.mean().backward()
            total = total + loss.mean().item()
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        return total, grads

    loss32, grads32 = run(None)
    loss_mixed, grads_mixed = run(dtype)
    assert math.isfinite(loss_mixed) and torch.isfinite(grads_mixed).all()
    assert abs(loss_mixed - loss32) / abs(loss32) <= 2e-2
    assert (grads_mixed - grads32).norm() / grads32.norm() <= 2e-2 * 5  # gradients are noisier than the loss


def test_half_precision_weights_forward_is_finite():
    """What DeepSpeed's bf16 mode does: the whole module in bf16, no autocast."""
    config = preset("tiny", mem_len=8)
    torch.manual_seed(0)
    model = TransformerXLLM(config).eval()
    reference = [model(x, y)[0] for x, y in _segments(config, n_segments=1)][0]
    model = model.to(torch.bfloat16)
    mems = None
    for x, y in _segments(config, n_segments=2):
        loss, mems = model(x, y, mems)
    ((x, y),) = _segments(config, n_segments=1)
    loss, _ = model(x, y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert abs(loss.mean().item() - reference.mean().item()) / reference.mean().item() <= 2e-2


# ---------------------------------------------------------------------------------------------------------------
# 7. gradcheck.


@pytest.mark.parametrize("impl", ["reference", "fused"])
def test_attention_gradcheck(impl):
    attn, u, v = _random_attention(impl, d_model=6, n_head=2, d_head=2)
    w = torch.randn(3, 2, 6, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(2, 2, 6, dtype=torch.float64, requires_grad=True)
    u.requires_grad_(True)
    v.requires_grad_(True)
    r = sinusoid_encoding(relative_positions(5, -1, w.device), 6, torch.float64)
    mask = attention_mask(3, 2, 4, True, w.device)
    assert torch.autograd.gradcheck(lambda w, mem, u, v: attn(w, r, mask, mem, u, v), (w, mem, u, v))


# ---------------------------------------------------------------------------------------------------------------
# 8. Parameter counts.


def _closed_form_parameters(c: ModelConfig) -> int:
    d_embed, d, hd = c.d_embed_resolved, c.d_model, c.n_head * c.d_head
    bounds = c.cluster_bounds()
    dims = c.cluster_dims() if c.div_val > 1 else [d_embed] * len(bounds)
    embeddings = sum((end - start) * dim for (start, end), dim in zip(bounds, dims))
    if c.div_val > 1:
        in_projs = sum(d * dim for dim in dims)
        out_projs = sum(d * dim for dim, tied in zip(dims, c.tie_projs_resolved) if not tied)
    else:
        in_projs = d * d_embed if d != d_embed else 0
        out_projs = sum(d * d_embed for tied in c.tie_projs_resolved if not tied) if d != d_embed else 0
    head = c.n_token + c.n_clusters * d_embed + c.n_clusters  # output biases, cluster weights and biases
    per_layer = 3 * hd * d + hd * d + hd * d + 2 * d + d * c.d_inner + c.d_inner + c.d_inner * d + d + 2 * d
    return embeddings + in_projs + out_projs + head + 2 * hd + c.n_layer * per_layer


@pytest.mark.parametrize(
    "name,authors_count", [("lm1b_base", 358e6), ("lm1b_large", 841e6), ("ptb_small", None), ("tiny", None)]
)
def test_parameter_counts(name, authors_count):
    config = preset(name)
    with torch.device("meta"):
        model = TransformerXLLM(config)
    count = model.num_parameters()
    assert count == _closed_form_parameters(config)
    if authors_count:
        assert abs(count - authors_count) / authors_count < 0.005


# ---------------------------------------------------------------------------------------------------------------
# Configuration errors name the field.


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(cutoffs=[600, 200]), "cutoffs"),
        (dict(cutoffs=[200, 1000]), "cutoffs"),
        (dict(div_val=0), "div_val"),
        (dict(tie_projs=[True]), "tie_projs"),
        (dict(dropout=1.5), "dropout"),
        (dict(attn_impl="flash"), "attn_impl"),
        (dict(mem_len=0, same_length=True), "same_length"),
        (dict(d_embed=64, div_val=128), "div_val"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"model.{field}="):
        preset("tiny", **overrides)


def test_unknown_preset_and_key():
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("lm1b_huge")
    with pytest.raises(ValueError, match="unknown key"):
        ModelConfig.from_dict({"n_layers": 3})
