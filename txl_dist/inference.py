"""Generation and scoring with a trained model, on token ids and on text, reusing Transformer-XL's memory.

Generation feeds the prompt in segments of ``tgt_len`` tokens and then one forward of one token per new token.
Each layer keeps the keys and values of its memory (at most ``mem_len`` positions) in a cache, so a new token
projects only itself; the context is never recomputed nor projected again. ``kv_cache=False`` keeps the memory
of hidden states instead (the paper's fast evaluation applied to decoding: every step projects the whole memory
again); both give the same tokens, and with a memory that covers the whole context, the tokens of a vanilla
Transformer that runs the whole prefix again for every new token.

Sampling uses its own ``torch.Generator`` (seeded by ``seed``), never the global random state.
"""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch

from txl_dist.evaluation import perplexity
from txl_dist.model import TransformerXLLM
from txl_dist.model.decoding import KVCache


@contextlib.contextmanager
def _inference(model: TransformerXLLM) -> Iterator[None]:
    """Eval mode and no autograd, then the model's previous mode back. (Not inference mode: the generators yield
    inside this block, and tensors their callers make meanwhile would become inference tensors.)"""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _device(model: TransformerXLLM) -> torch.device:
    return next(model.parameters()).device


def _check_ids(model: TransformerXLLM, ids: Sequence[int], what: str) -> None:
    n_token = model.config.n_token
    bad = [token for token in ids if not 0 <= token < n_token]
    if bad:
        raise ValueError(f"{what}: token id(s) {bad[:5]} outside the vocabulary [0, {n_token})")


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [V] -> bool [V]: the smallest set of most probable tokens whose probabilities sum to >= top_p."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order] = mass_before < top_p
    return keep


class TokenSampler:
    """Chooses the next token from log-probabilities: greedy, or sampled with temperature, top-k and nucleus
    (top-p) filtering, from a private generator."""

    def __init__(
        self,
        device: torch.device,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        greedy: bool = False,
    ):
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be > 0 (use greedy=True for the most probable token)")
        if not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 keeps every token)")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p} must be in (0, 1] (1 keeps every token)")
        self.temperature, self.top_k, self.top_p, self.greedy = temperature, top_k, top_p, greedy
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def from_hidden(self, model: TransformerXLLM, hidden: torch.Tensor) -> int:
        """The final hidden state of the newest position [1, d_model] -> a token id. Greedy takes the adaptive
        softmax's exact argmax (`ProjectedAdaptiveLogSoftmax.argmax`: tail clusters that cannot hold the winner
        are skipped); sampling needs the whole distribution."""
        if self.greedy:
            return int(model.crit.argmax(hidden)[0])
        return self(model.crit.log_prob(hidden)[0])

    def __call__(self, log_probs: torch.Tensor) -> int:
        """log_probs [V] -> a token id."""
        if self.greedy:
            return int(log_probs.argmax())
        logits = log_probs.float() / self.temperature
        if self.top_k > 0 and self.top_k < logits.numel():
            kth_largest = logits.topk(self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1:
            probs = probs * nucleus_mask(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class IncrementalDecoder:
    """Feeds tokens to a model one call at a time, keeping the key/value cache (or, with ``kv_cache=False``,
    the memory of hidden states) between calls.

    ``feed(ids)`` runs ids through the model (in segments of ``tgt_len``) after everything fed before and returns
    the log-probabilities of the token that follows [V]. Put the model in eval mode first.
    """

    def __init__(self, model: TransformerXLLM, kv_cache: bool = True):
        self.model = model
        self.device = _device(model)
        self.cache = KVCache(model) if kv_cache else None
        self.mems: list[torch.Tensor] | None = None

    def feed(self, ids: Sequence[int]) -> torch.Tensor:
        """Log-probabilities [V] of the token after ``ids`` (and everything fed before)."""
        with torch.no_grad():
            return self.model.crit.log_prob(self.feed_hidden(ids))[0]

    @torch.no_grad()
    def feed_hidden(self, ids: Sequence[int]) -> torch.Tensor:
        """Like `feed`, but the final hidden state of the newest position [1, d_model]."""
        if not ids:
            raise ValueError("feed: no token ids given")
        _check_ids(self.model, ids, "ids")
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        segment = self.model.segment.tgt_len
        for start in range(0, tokens.shape[1], segment):
            if self.cache is not None:
                hidden = self.cache.hidden_states(tokens[:, start : start + segment])
            else:
                hidden, self.mems = self.model.hidden_states(tokens[:, start : start + segment], self.mems)
        return hidden[-1]  # hidden [L, 1, d_model]: the newest position


def iter_generate_ids(
    model: TransformerXLLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    greedy: bool = False,
    stop_ids: Collection[int] = (),
    kv_cache: bool = True,
) -> Iterator[int]:
    """The new tokens (not the prompt) after ``prompt_ids``, one at a time as they are decoded (see
    `generate_ids`)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token (e.g. the end-of-sentence id)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    _check_ids(model, prompt_ids, "prompt_ids")
    choose = TokenSampler(_device(model), temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, greedy=greedy)
    if max_new_tokens == 0:
        return
    with _inference(model):
        decoder = IncrementalDecoder(model, kv_cache=kv_cache)
        ids = list(prompt_ids)
        for count in range(1, max_new_tokens + 1):
            # Inference mode (no version counting, a noticeable share of decoding a small model) around the work
            # only, not around the yield, where tensors the caller makes would become inference tensors.
            with torch.inference_mode():
                token = choose.from_hidden(model, decoder.feed_hidden(ids))
            yield token
            if token in stop_ids or count == max_new_tokens:
                break
            ids = [token]


def generate_ids(
    model: TransformerXLLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    greedy: bool = False,
    stop_ids: Collection[int] = (),
    kv_cache: bool = True,
) -> list[int]:
    """The new tokens (not the prompt) after ``prompt_ids``, decoded incrementally.

    The prompt goes in segments of ``model.segment.tgt_len``; each new token then costs one forward of one token,
    with the key/value cache (``kv_cache=False``: with the memory of hidden states, which projects it again at
    every step; same tokens, slower). The model sees at most ``mem_len`` earlier positions (plus the current one)
    at every layer. Generation stops after ``max_new_tokens`` tokens or after emitting one of ``stop_ids`` (which
    is included).
    """
    return list(
        iter_generate_ids(
            model,
            prompt_ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            greedy=greedy,
            stop_ids=stop_ids,
            kv_cache=kv_cache,
        )
    )


def score_ids(
    model: TransformerXLLM, ids_list: Sequence[Sequence[int]], context_id: int, *, batch_size: int = 16
) -> list[tuple[float, int]]:
    """(log-probability in nats, number of scored tokens) of each token sequence, scored as a document.

    A sequence ``ids`` is read as ``[context_id] + ids`` and predicts ``ids + [context_id]``: it is conditioned
    on the separator that precedes every document in the training stream and must end the way documents end, so
    ``n_tokens = len(ids) + 1``. Sequences are scored in batches (right-padded, which cannot affect a causal
    model), in segments of ``tgt_len`` with the memory, so a sequence longer than ``mem_len + tgt_len`` sees a
    bounded context, as in evaluation. Perplexity is ``exp(-logprob / n_tokens)``.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    _check_ids(model, [context_id], "context_id")
    for index, ids in enumerate(ids_list):
        _check_ids(model, ids, f"ids_list[{index}]")
    device = _device(model)
    segment = model.segment.tgt_len
    results: list[tuple[float, int]] = [(0.0, 0)] * len(ids_list)
    by_length = sorted(range(len(ids_list)), key=lambda index: len(ids_list[index]))
    with _inference(model):
        for first in range(0, len(by_length), batch_size):
            batch = by_length[first : first + batch_size]
            n_targets = torch.tensor([len(ids_list[index]) + 1 for index in batch], device=device)
            width = int(n_targets.max())
            data = torch.full((len(batch), width + 1), context_id, dtype=torch.long, device=device)
            for row, index in enumerate(batch):
                if ids_list[index]:
                    data[row, 1 : len(ids_list[index]) + 1] = torch.tensor(list(ids_list[index]), device=device)
            scored = torch.arange(width, device=device)[None, :] < n_targets[:, None]  # [B, width]
            nll = torch.zeros(len(batch), dtype=torch.float64, device=device)
            mems = None
            for start in range(0, width, segment):
                window = slice(start, min(start + segment, width))
                loss, mems = model(data[:, window], data[:, window.start + 1 : window.stop + 1], mems)
                nll += torch.where(scored[:, window], loss.double(), 0.0).sum(dim=1)
            for row, index in enumerate(batch):
                results[index] = (-float(nll[row]), int(n_targets[row]))
    return results


# ---------------------------------------------------------------------------------------------------------------
# Text in, text out (the tokenizer of an export: ``model, tokenizer = txl_dist.load_pretrained(EXPORT)``).


class TextStream:
    """Turns generated ids into text as they come: `push` returns the text that token adds (possibly ""), and
    `finish` what is still held back. Joined, the pieces equal ``tokenizer.decode_document(ids)``.

    A token's text is decoded after a few tokens of its line as context (sentencepiece marks word starts on the
    piece itself, so a piece alone would decode without its space), which keeps each step's work constant
    however long the line. Separators (eos/eod) become line breaks once more text follows, as in
    `decode_document`.
    """

    CONTEXT = 4

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.separators = {tokenizer.eos_id, tokenizer.eod_id}
        self.line: list[int] = []
        self.pending_breaks = 0
        # Bytes become text as their UTF-8 characters complete; a byte that is not UTF-8 prints as U+FFFD.
        self._utf8 = (
            codecs.getincrementaldecoder("utf-8")("replace") if getattr(tokenizer, "kind", None) == "byte" else None
        )

    def push(self, token_id: int) -> str:
        if self._utf8 is not None and token_id not in self.separators:
            breaks = "\n" * self.pending_breaks
            self.pending_breaks = 0
            return breaks + self._utf8.decode(self.tokenizer.decode_bytes([token_id]))
        if token_id in self.separators:
            if self._utf8 is not None:  # a line break ends an unfinished character
                flushed = self._utf8.decode(b"", final=True)
                self._utf8.reset()
                self.pending_breaks += 1
                return flushed
            self.pending_breaks += 1
            self.line = []
            return ""
        breaks = "\n" * self.pending_breaks
        self.pending_breaks = 0
        context = self.line[-self.CONTEXT :]
        before = self.tokenizer.decode(context) if context else ""
        after = self.tokenizer.decode(context + [token_id])
        self.line.append(token_id)
        return breaks + (after[len(before) :] if after.startswith(before) else after)

    def finish(self) -> str:
        """Separators at the end: n of them close n - 1 empty lines (decode_document's convention)."""
        tail = "\n" * max(0, self.pending_breaks - 1)
        self.pending_breaks = 0
        if self._utf8 is not None:
            tail = self._utf8.decode(b"", final=True) + tail
            self._utf8.reset()
        return tail


def iter_generate(
    model: TransformerXLLM,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = 50,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    greedy: bool = False,
) -> Iterator[str]:
    """The text that follows ``prompt``, piece by piece as tokens are decoded (see `generate`)."""
    # After the separator, as a document starts; a tokenizer that begins lines with a word (the authors' <S>) too.
    prompt_ids = [tokenizer.eod_id] + tokenizer.line_prefix() + tokenizer.encode(prompt)
    stream = TextStream(tokenizer)
    for token in iter_generate_ids(
        model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, greedy=greedy
    ):
        piece = stream.push(token)
        if piece:
            yield piece
    tail = stream.finish()
    if tail:
        yield tail


def generate(
    model: TransformerXLLM,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = 50,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    greedy: bool = False,
) -> str:
    """The text that follows ``prompt``, decoded incrementally (one forward of one token per new token).

    The prompt is read as the start of a document: it follows the document separator, as every document of the
    training stream does. Separators in the output come back as line breaks (`decode_document`).
    """
    return "".join(
        iter_generate(
            model,
            tokenizer,
            prompt,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            greedy=greedy,
        )
    )


def score(
    model: TransformerXLLM, tokenizer: Any, texts: Sequence[str], *, batch_size: int = 16
) -> list[dict[str, float | int]]:
    """Per text: ``logprob`` (nats, of its tokens and the closing separator, given the opening one), ``tokens``
    (how many were scored), ``ppl`` = exp(-logprob / tokens) and ``unknown``: how many of its tokens are the
    unknown token. Text the vocabulary does not know scores as the unknown token, which a model usually finds
    likely: such perplexities are not comparable with those of known text. See `score_ids`."""
    encoded = [tokenizer.line_prefix() + tokenizer.encode(text) for text in texts]
    scored = score_ids(model, encoded, tokenizer.eod_id, batch_size=batch_size)
    unk = getattr(tokenizer, "unk_id", None)
    return [
        {
            "logprob": logprob,
            "tokens": n,
            "ppl": perplexity(-logprob / n),
            "unknown": sum(token == unk for token in ids) if unk is not None else 0,
        }
        for (logprob, n), ids in zip(scored, encoded)
    ]
