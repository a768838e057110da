"""Runs in the current-transformers environment (.venv-hf), where txl_dist is not installed: loads folders written
by `launchers/convert.py export-to-hub` with transformers only and records what tests/test_hub_export.py compares.

    .venv-hf/bin/python -I tests/hub_worker.py JOBS.json RESULTS.pt

JOBS.json: {"models": [{"name", "folder", "data", "segment", "prompt", "new_tokens", "padded_prompts"?,
"sample"?}], "tokenizers": [{"name", "folder", "lines", "document"}], "decoding": [{"name", "folder",
"vocab_size", "sequences", "texts", "refused"}]}. RESULTS.pt: a dict of plain lists and tensors (read back with
torch.load(weights_only=True)). Nothing here may import txl_dist.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


def segment_nll(model, data: torch.Tensor, segment: int) -> dict[str, torch.Tensor]:
    """Negative log-likelihood of every next token, three ways: segment by segment with the memory as the cache
    (from logits, and from labels), and in one call over all segments."""
    n_segments = (data.shape[1] - 1) // segment
    from_logits, from_labels, mean_losses, cache = [], [], [], None
    with torch.no_grad():
        for s in range(n_segments):
            inputs = data[:, s * segment : (s + 1) * segment]
            targets = data[:, s * segment + 1 : (s + 1) * segment + 1]
            out = model(input_ids=inputs, labels=inputs, cache=cache)
            cache = out.cache
            from_logits.append(-out.logits.gather(2, targets.unsqueeze(-1)).squeeze(-1))
            from_labels.append(out.losses)
            mean_losses.append(out.loss)
        whole = model(input_ids=data[:, : n_segments * segment]).logits
    one_call = -whole.gather(2, data[:, 1 : n_segments * segment + 1].unsqueeze(-1)).squeeze(-1)
    return {
        "from_logits": torch.stack(from_logits),
        "from_labels": torch.stack(from_labels),
        "mean_loss": torch.stack(mean_losses),
        "one_call": one_call,
        "memory_positions": cache.length,
        "memory_seen": cache.seen,
    }


def exact_length(**settings):
    """generate() settings that produce exactly max_new_tokens tokens (no stop at the end-of-document token)."""
    return dict(settings, eos_token_id=None, pad_token_id=None)


def check_model(job: dict) -> dict:
    model, info = AutoModelForCausalLM.from_pretrained(job["folder"], trust_remote_code=True, output_loading_info=True)
    model.eval()
    result: dict = {
        "class": type(model).__name__,
        "config_class": type(AutoConfig.from_pretrained(job["folder"], trust_remote_code=True)).__name__,
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": sorted(str(k) for k in info["mismatched_keys"]),
    }
    result["ties"] = {
        target: model.get_parameter(target) is model.get_parameter(source)
        for target, source in model._tied_weights_keys.items()
    }
    result.update(segment_nll(model, torch.tensor(job["data"]), job["segment"]))
    prompt = torch.tensor([job["prompt"]])
    # The length of the input of every forward that generate() makes: with the memory as its cache, the prompt
    # once, then one token per new token.
    lengths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(
            int((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1])
        ),
        with_kwargs=True,
    )
    greedy = model.generate(prompt, **exact_length(max_new_tokens=job["new_tokens"], do_sample=False))
    hook.remove()
    result["greedy"] = greedy[0, prompt.shape[1] :].tolist()
    result["greedy_forward_lengths"] = lengths
    if job.get("padded_prompts"):
        prompts = job["padded_prompts"]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        padded = model.generate(
            ids, attention_mask=mask, **exact_length(max_new_tokens=job["new_tokens"], do_sample=False)
        )
        result["padded_greedy"] = padded[:, width:].tolist()
        with torch.no_grad():  # every position of every row, against the row alone
            together = model(ids, attention_mask=mask).logits
            result["padded_logprob_diff"] = max(
                (together[row, width - len(p) :] - model(torch.tensor([p])).logits[0]).abs().max().item()
                for row, p in enumerate(prompts)
            )
    if job.get("sample"):
        runs = []
        for seed in (7, 7, 8):
            transformers.set_seed(seed)
            out = model.generate(
                prompt,
                **exact_length(max_new_tokens=job["new_tokens"], do_sample=True, top_k=50, top_p=0.9, temperature=1.0),
            )
            runs.append(out[0, prompt.shape[1] :].tolist())
        result["samples"] = runs
        beams = model.generate(prompt, **exact_length(max_new_tokens=4, do_sample=False, num_beams=2))
        result["beam_tokens"] = beams[0, prompt.shape[1] :].tolist()
    return result


def check_tokenizer(job: dict) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    document = tokenizer(job["document"])["input_ids"]
    return {
        "class": type(tokenizer).__name__,
        "lines": tokenizer(job["lines"], add_special_tokens=False)["input_ids"],
        "document": document,
        "decoded": tokenizer.decode(document),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "padded": tokenizer(job["lines"][:2], padding=True, return_tensors="pt")["attention_mask"].tolist(),
    }


def _outcome(function, *args, **kwargs) -> object:
    """What ``function(*args, **kwargs)`` returns, or the text of what it raised (a panic in the Rust code of
    tokenizers included: pyo3's PanicException is a BaseException), so that one bad input hides no other."""
    try:
        return function(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:
        return f"raised {type(error).__name__}: {error}"


def check_decoding(job: dict) -> dict:
    """Every id alone, the given short sequences (the empty one included), with and without the special tokens;
    the ids of short texts, and what the texts the tokenizer must refuse give."""
    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    singles = [[i] for i in range(job["vocab_size"])]
    return {
        "singles": [_outcome(tokenizer.decode, ids) for ids in singles],
        "sequences": [_outcome(tokenizer.decode, ids) for ids in job["sequences"]],
        "skipping_specials": [
            _outcome(tokenizer.decode, ids, skip_special_tokens=True) for ids in singles + job["sequences"]
        ],
        "texts": [_outcome(lambda text: tokenizer(text)["input_ids"], text) for text in job["texts"]],
        "refused": [_outcome(lambda text: tokenizer(text)["input_ids"], text) for text in job["refused"]],
    }


def main(jobs_path: str, results_path: str) -> None:
    jobs = json.loads(open(jobs_path, encoding="utf-8").read())
    results = {
        "transformers": transformers.__version__,
        "txl_dist_importable": importlib.util.find_spec("txl_dist") is not None,
        "models": {job["name"]: check_model(job) for job in jobs.get("models", [])},
        "tokenizers": {job["name"]: check_tokenizer(job) for job in jobs.get("tokenizers", [])},
        "decoding": {job["name"]: check_decoding(job) for job in jobs.get("decoding", [])},
    }
    torch.save(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
