"""Incremental generation with the memory, sampling, and scoring on token ids."""

from __future__ import annotations

import math

import pytest
import torch

from tests.recompute import generate_ids_recompute
from txl_dist.inference import (
    IncrementalDecoder,
    TokenSampler,
    generate_ids,
    iter_generate_ids,
    nucleus_mask,
    score_ids,
)
from txl_dist.model import TransformerXLLM, decoding, preset
from txl_dist.model.decoding import KVCache
from txl_dist.model.recurrence import SegmentSettings

PROMPT = [5, 17, 230, 999, 42, 640, 3, 3, 77, 501, 12, 800, 9]  # 13 tokens: two segments of tgt_len 8


def _model(**overrides) -> TransformerXLLM:
    """A tiny random model with spread-out logits (so that greedy choices are not decided by rounding)."""
    torch.manual_seed(0)
    model = TransformerXLLM(preset("tiny", tgt_len=8, **overrides)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def test_greedy_with_memory_equals_full_recomputation_when_the_memory_covers_the_context():
    model = _model(mem_len=40)  # prompt 13 + 20 new tokens fit
    incremental = generate_ids(model, PROMPT, 20, greedy=True)
    recomputed = generate_ids_recompute(model, PROMPT, 20, greedy=True)
    assert len(incremental) == 20 and len(set(incremental)) > 5  # not a degenerate repetition
    assert incremental == recomputed


def test_incremental_log_probs_equal_one_segment_over_the_whole_prefix():
    """Stronger than greedy agreement (a random model's argmax barely depends on distant context): every
    next-token distribution of the incremental decoder equals the one computed from the whole prefix."""
    model = _model(mem_len=40)
    continuation = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    decoder = IncrementalDecoder(model)
    incremental = [decoder.feed(PROMPT)] + [decoder.feed([token]) for token in continuation]
    with torch.no_grad():
        whole, _ = model(torch.tensor([PROMPT + continuation]))
    for step, log_probs in enumerate(incremental):
        assert (log_probs - whole[0, len(PROMPT) - 1 + step]).abs().max().item() <= 1e-5


def test_one_token_steps_after_mem_len_is_lowered_see_what_the_masked_path_sees():
    """same_length with a cache holding more positions than a lowered mem_len: the one-token step sees the newest
    mem_len positions (itself included), as the masked general path does."""
    model = _model(mem_len=12, same_length=True)
    tokens = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        cache = KVCache(model)
        cache.hidden_states(tokens[:, :16])
        _, mems = model.hidden_states(tokens[:, :16])
        lowered = SegmentSettings(tgt_len=8, mem_len=5, clamp_len=model.segment.clamp_len, same_length=True)
        step = cache.hidden_states(tokens[:, 16:17], lowered)
        expected, _ = model.hidden_states(tokens[:, 16:17], mems, lowered)
    assert (step - expected).abs().max().item() <= 1e-5


def test_a_short_memory_forgets_so_the_comparison_can_fail():
    model = _model(mem_len=4)
    assert generate_ids(model, PROMPT, 20, greedy=True) != generate_ids_recompute(model, PROMPT, 20, greedy=True)


@pytest.mark.parametrize("mem_len", [3, 6])
def test_same_length_attention_spans_agree_for_any_memory(mem_len):
    """With same_length every query sees exactly mem_len positions in both paths, so they agree."""
    model = _model(mem_len=mem_len, same_length=True)
    assert generate_ids(model, PROMPT, 15, greedy=True) == generate_ids_recompute(model, PROMPT, 15, greedy=True)


def test_one_forward_of_one_token_per_new_token():
    model = _model(mem_len=40)
    embedded_lengths = []
    hook = model.word_emb.register_forward_hook(lambda module, args, out: embedded_lengths.append(args[0].numel()))
    try:
        new = generate_ids(model, PROMPT, 10, greedy=True)
    finally:
        hook.remove()
    # The prompt in segments of tgt_len = 8, then each new token but the last is fed once, alone.
    assert len(new) == 10
    assert embedded_lengths == [8, 5] + [1] * 9


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"pre_lnorm": True},
        {"untie_r": True},
        {"same_length": True},
        {"clamp_len": 3},
        {"mem_len": 0},
        {"dtype": torch.bfloat16},
    ],
    ids=["default", "pre_lnorm", "untie_r", "same_length", "clamp_len", "mem_len_0", "bf16"],
)
def test_one_token_steps_with_the_cache_equal_the_memory_path(overrides, monkeypatch):
    """Every one-token step of `KVCache.hidden_states` (`decode_step`: no mask, no shift, no module calls)
    gives the hidden states of `hidden_states` with the memory, for a batch of 3, past several moves of the
    cache's buffer, in every attention variant."""
    overrides = dict(overrides)
    dtype = overrides.pop("dtype", torch.float32)
    model = _model(**{"mem_len": 6, **overrides}).to(dtype)
    steps = []
    original = decoding.decode_step
    monkeypatch.setattr(decoding, "decode_step", lambda *args: steps.append(1) or original(*args))
    tokens = torch.randint(0, 1000, (3, 48), generator=torch.Generator().manual_seed(5))
    cache = KVCache(model)
    hidden = cache.hidden_states(tokens[:, :8])
    expected, mems = model.hidden_states(tokens[:, :8])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for t in range(8, tokens.shape[1]):
        hidden = cache.hidden_states(tokens[:, t : t + 1])
        expected, mems = model.hidden_states(tokens[:, t : t + 1], mems)
        assert hidden.shape == expected.shape == (1, 3, model.config.d_model)
        scale = 1.0 if dtype == torch.float32 else expected.abs().max().item()
        assert (hidden.float() - expected.float()).abs().max().item() <= tolerance * scale, t
        if t == 30:  # a position bias changed in place between steps: the cache's scaled copy follows
            with torch.no_grad():
                (model.r_w_bias if model.r_w_bias is not None else model.layers[1].dec_attn.r_w_bias).add_(0.5)
    assert len(steps) == model.config.n_layer * 40


def test_a_model_made_under_inference_mode_generates_and_callers_tensors_stay_ordinary():
    """Biases without a version counter (made under inference mode) are scaled anew for every token, and the
    generator does not switch inference mode on around the caller's code between tokens."""
    with torch.inference_mode():
        model = _model(mem_len=40)
        inside = generate_ids(model, PROMPT, 8, greedy=True)
    assert inside == generate_ids(_model(mem_len=40), PROMPT, 8, greedy=True)
    for _ in iter_generate_ids(_model(mem_len=40), PROMPT, 3, greedy=True):
        made_between_tokens = torch.ones(2)
        assert not made_between_tokens.is_inference()


def test_sampling_is_seeded_and_leaves_the_global_generator_alone():
    model = _model(mem_len=40)
    global_state = torch.get_rng_state()
    first = generate_ids(model, PROMPT, 15, temperature=1.5, seed=123)
    second = generate_ids(model, PROMPT, 15, temperature=1.5, seed=123)
    other = generate_ids(model, PROMPT, 15, temperature=1.5, seed=7)
    assert torch.equal(torch.get_rng_state(), global_state)
    assert first == second and first != other
    # Both decoders draw from the same distributions with the same generator: the same sample.
    assert generate_ids_recompute(model, PROMPT, 15, temperature=1.5, seed=123) == first


def test_top_k_one_is_greedy():
    model = _model(mem_len=40)
    assert generate_ids(model, PROMPT, 12, top_k=1, temperature=2.0, seed=5) == generate_ids(
        model, PROMPT, 12, greedy=True
    )


def test_stop_ids_end_generation():
    model = _model(mem_len=40)
    free = generate_ids(model, PROMPT, 12, greedy=True)
    stop = free[4]
    stopped = generate_ids(model, PROMPT, 12, greedy=True, stop_ids={stop})
    assert stopped == free[: free.index(stop) + 1]


def test_nucleus_keeps_the_smallest_set_with_enough_mass():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])  # sorted: 0.4 (1), 0.3 (3), 0.15 (4), 0.1 (0), 0.05 (2)
    kept = lambda p: set(nucleus_mask(probs, p).nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.3) == {1}
    assert kept(0.4) == {1}
    assert kept(0.6) == {1, 3}
    assert kept(0.8) == {1, 3, 4}
    assert kept(0.9) == {0, 1, 3, 4}
    assert kept(0.99) == {0, 1, 2, 3, 4}


def test_sampler_filters():
    log_probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]).log()

    def draws(**kwargs) -> set[int]:
        sampler = TokenSampler(torch.device("cpu"), seed=0, **kwargs)
        return {sampler(log_probs) for _ in range(300)}

    assert draws() == {0, 1, 2, 3, 4}
    assert draws(top_k=2) == {1, 3}
    assert draws(top_p=0.8) == {1, 3, 4}
    assert draws(top_k=2, top_p=0.3) == {1}
    assert draws(greedy=True) == {1}
    with pytest.raises(ValueError, match="temperature=0"):
        TokenSampler(torch.device("cpu"), temperature=0)
    with pytest.raises(ValueError, match="top_p=1.5"):
        TokenSampler(torch.device("cpu"), top_p=1.5)


def test_bad_ids_are_named():
    model = _model()
    with pytest.raises(ValueError, match=r"prompt_ids: token id\(s\) \[1000\]"):
        generate_ids(model, [1, 1000], 3)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        generate_ids(model, [], 3)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        generate_ids(model, [1], -1)
    assert generate_ids(model, [1], 0) == []
    with pytest.raises(ValueError, match=r"ids_list\[1\]: token id\(s\) \[-1\]"):
        score_ids(model, [[1], [-1]], context_id=1)


def _reference_score(model: TransformerXLLM, ids: list[int], context_id: int) -> float:
    """Sum of log p(target) over one segment of [context] + ids (every position sees all earlier ones)."""
    data = torch.tensor([[context_id] + ids + [context_id]])
    with torch.no_grad():
        log_probs, _ = model(data[:, :-1])
    return log_probs[0].gather(1, data[0, 1:, None]).sum().item()


def test_score_ids_equals_one_segment_scoring():
    model = _model(mem_len=64)
    texts = [[4, 8, 15, 16, 23, 42] * 3, [], [999], list(range(100, 131)), [7, 7, 7]]
    scores = score_ids(model, texts, context_id=1, batch_size=2)
    for (logprob, n_tokens), ids in zip(scores, texts):
        assert n_tokens == len(ids) + 1
        assert abs(logprob - _reference_score(model, ids, 1)) <= 1e-4 * max(1.0, abs(logprob))
    # Batching (with padding) does not change a text's score.
    one_by_one = [score_ids(model, [ids], context_id=1)[0] for ids in texts]
    assert all(math.isclose(a[0], b[0], rel_tol=1e-5) and a[1] == b[1] for a, b in zip(scores, one_by_one))


@pytest.mark.parametrize("kind", ["word", "sentencepiece"])
def test_streamed_text_equals_the_decoded_document(kind, ptb_word_tokenizer, ptb_sentencepiece_tokenizer):
    """Pieces pushed one token at a time join to decode_document's text, separators (line breaks, also
    leading, repeated and trailing) included."""
    from txl_dist.inference import TextStream
    from txl_dist.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ptb_word_tokenizer if kind == "word" else ptb_sentencepiece_tokenizer)
    rng = torch.Generator().manual_seed(0)
    separators = [tokenizer.eos_id, tokenizer.eod_id]
    for trial in range(30):
        ids = torch.randint(
            0, tokenizer.vocab_size, (int(torch.randint(1, 60, (1,), generator=rng)),), generator=rng
        ).tolist()
        for position in torch.randint(0, len(ids), (trial % 5,), generator=rng).tolist():
            ids[position] = separators[position % 2]
        if trial % 3 == 0:
            ids = separators[:1] + ids + separators[:1] * (trial % 4)
        stream = TextStream(tokenizer)
        pieces = [stream.push(token) for token in ids] + [stream.finish()]
        assert "".join(pieces) == tokenizer.decode_document(ids), ids


# ---- sampling distributions ------------------------------------------------------------------------------------


def _draw_frequencies(sampler: TokenSampler, log_probs: torch.Tensor, draws: int) -> torch.Tensor:
    counts = torch.zeros(log_probs.numel(), dtype=torch.float64)
    for _ in range(draws):
        counts[sampler(log_probs)] += 1
    return counts / draws


@pytest.mark.parametrize("temperature, top_k", [(0.5, 0), (2.0, 0), (0.7, 3), (1.0, 2)])
def test_samples_follow_the_tempered_and_truncated_distribution(temperature, top_k):
    """Over 5,000 seeded draws every token's frequency lies within 5 standard errors of p_i^(1/T), kept to the k
    most probable and renormalised; the sampler's own arithmetic (softmax of log p / T) is not reused."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)
    tempered = probs ** (1.0 / temperature)
    if top_k:
        tempered[probs.argsort(descending=True)[top_k:]] = 0.0
    expected = tempered / tempered.sum()
    draws = 5_000
    frequencies = _draw_frequencies(
        TokenSampler(torch.device("cpu"), temperature=temperature, top_k=top_k, seed=11), probs.float().log(), draws
    )
    tolerance = 5 * (expected * (1 - expected) / draws).sqrt() + 1e-12
    assert ((frequencies - expected).abs() <= tolerance).all(), (frequencies, expected)
    # The premise that makes this a test of the settings: the untempered, untruncated distribution fails it.
    assert ((frequencies - probs).abs() > tolerance).any()


# ---- text in, text out -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def word_model_and_tokenizer(ptb_word_tokenizer):
    from txl_dist.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ptb_word_tokenizer)
    return _model(n_token=tokenizer.vocab_size, mem_len=40), tokenizer


@pytest.mark.parametrize(
    "sampling", [dict(greedy=True), dict(temperature=0.8, top_k=20, seed=4), dict(temperature=1.6, top_p=0.9, seed=4)]
)
def test_text_generation_is_the_decoded_id_generation_after_the_document_separator(word_model_and_tokenizer, sampling):
    from txl_dist.inference import generate, iter_generate

    model, tokenizer = word_model_and_tokenizer
    prompt = "the company said it expects"
    ids = generate_ids(model, [tokenizer.eod_id] + tokenizer.encode(prompt), 25, **sampling)
    text = generate(model, tokenizer, prompt, 25, **sampling)
    assert text == tokenizer.decode_document(ids)
    assert "".join(iter_generate(model, tokenizer, prompt, 25, **sampling)) == text
    assert len(text.split()) >= 10


def test_text_generation_passes_temperature_and_top_k_on(word_model_and_tokenizer):
    """The same seed with another temperature or top_k draws other text: the settings reach the sampler."""
    from txl_dist.inference import generate

    model, tokenizer = word_model_and_tokenizer
    texts = {
        (temperature, top_k): generate(model, tokenizer, "the market", 30, temperature=temperature, top_k=top_k, seed=9)
        for temperature, top_k in ((1.0, 0), (0.3, 0), (1.0, 3))
    }
    assert len(set(texts.values())) == 3, texts
    # top_k=3: every new token is one of the 3 most probable after its context, which the greedy text shares at
    # each step at most -- checked on ids: each drawn id ranks in the top 3 of the model's distribution.
    prompt_ids = [tokenizer.eod_id] + tokenizer.encode("the market")
    drawn = generate_ids(model, prompt_ids, 30, top_k=3, seed=9)
    decoder = IncrementalDecoder(model)
    log_probs = decoder.feed(prompt_ids)
    for token in drawn:
        assert token in log_probs.topk(3).indices.tolist()
        log_probs = decoder.feed([token])


def test_text_scores_are_the_id_scores_with_unknown_words_counted(word_model_and_tokenizer, ptb_word_tokenizer):
    from txl_dist.inference import score

    model, tokenizer = word_model_and_tokenizer
    vocabulary = {line.split("\t")[0] for line in (ptb_word_tokenizer / "vocab.txt").read_text().splitlines()}
    texts = ["the company said", "zzqx blorf the", "", "the the the the the the the the the the the the"]
    results = score(model, tokenizer, texts, batch_size=2)
    expected = score_ids(model, [tokenizer.encode(text) for text in texts], tokenizer.eod_id)
    for text, result, (logprob, n_tokens) in zip(texts, results, expected):
        assert result["tokens"] == n_tokens == len(text.split()) + 1
        assert math.isclose(result["logprob"], logprob, rel_tol=1e-6)
        assert math.isclose(result["ppl"], math.exp(-logprob / n_tokens), rel_tol=1e-9)
        assert result["unknown"] == sum(word not in vocabulary for word in text.split())
    assert [r["unknown"] for r in results] == [0, 2, 0, 0]
