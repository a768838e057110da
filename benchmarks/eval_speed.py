"""Evaluation speed with the memory vs a vanilla Transformer's sliding window (the paper's section 4.4 comparison),
and generation speed with the memory vs full recomputation, side by side.

    python benchmarks/eval_speed.py                                  # ptb_small-shaped layers on this CPU
    python benchmarks/eval_speed.py --lengths 128,256,640 --batch 4 --repeats 3
    python benchmarks/eval_speed.py --device cuda --preset lm1b_base --batch 16 --lengths 128,256,640,3800

For an attention length L, Transformer-XL evaluates segments of L/4 tokens with a memory of 3L/4 (every
prediction sees up to L positions), while the vanilla model recomputes a window of the last L tokens for each
predicted token and scores only its last position. Both are timed after warm-up; the variants alternate within
each repeat so machine noise hits them alike; the summary quotes medians and the median of per-repeat ratios.
The paper reports up to 1,874x at L = 3,800 on GPUs; small models at short L on a CPU give less.

Generation: greedy decoding of --new-tokens after a --prompt-tokens prompt (mem_len covering the whole
context), three ways: one forward of one token per new token with the per-layer key/value cache (the default of
txl_dist.inference), the same with the memory of hidden states only (every step projects keys and values over
the whole memory again), and recomputing the whole prefix per token. All three give the same tokens (checked).
On CPUs with one thread the clock is the thread's CPU time (``time.thread_time``), which leaves out the time
the process waits for a core on a shared machine.
The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from txl_dist.inference import generate_ids
from txl_dist.model import TransformerXLLM, preset
from txl_dist.model.recurrence import SegmentSettings


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _clock(device: torch.device):
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


@torch.no_grad()
def eval_with_memory(
    model: TransformerXLLM, data: torch.Tensor, segment: int, warmup: int, settings: SegmentSettings | None = None
) -> float:
    """Tokens scored per second: segments of ``segment`` tokens, each with the memory of the previous ones (of
    ``settings.mem_len`` positions; the model's own settings unless given). ``data`` [B, n] holds warmup + timed
    segments (+1 for the last target)."""
    n_segments = (data.shape[1] - 1) // segment
    clock = _clock(data.device)
    mems = None
    for index in range(n_segments):
        if index == warmup:
            _sync(data.device)
            start = clock()
        window = slice(index * segment, (index + 1) * segment)
        loss, mems = model(data[:, window], data[:, window.start + 1 : window.stop + 1], mems, segment=settings)
    _sync(data.device)
    return data.shape[0] * segment * (n_segments - warmup) / (clock() - start)


@torch.no_grad()
def eval_sliding_window(
    model: TransformerXLLM,
    data: torch.Tensor,
    length: int,
    predictions: int,
    warmup: int,
    settings: SegmentSettings | None = None,
) -> float:
    """Tokens scored per second by a vanilla Transformer: for each predicted token, one forward over the window
    of the ``length`` tokens before it, scoring only the window's last position."""
    clock = _clock(data.device)
    for index in range(warmup + predictions):
        if index == warmup:
            _sync(data.device)
            start = clock()
        window = data[:, index : index + length]
        hidden, _ = model.hidden_states(window, None, settings)  # [length, B, d_model], no memory
        model.crit(hidden[-1], data[:, index + length].contiguous())
    _sync(data.device)
    return data.shape[0] * predictions / (clock() - start)


@torch.inference_mode()
def generate_recompute(model: TransformerXLLM, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding as a vanilla Transformer does it: every new token runs the whole prefix again, in one
    segment without memory."""
    device = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(new_tokens):
        hidden, _ = model.hidden_states(torch.tensor([ids], dtype=torch.long, device=device))
        ids.append(int(model.crit.argmax(hidden[-1])[0]))
    return ids[len(prompt) :]


def with_mem_len(model: TransformerXLLM, mem_len: int) -> TransformerXLLM:
    """The same weights with another memory length, for `generate_ids` (which decodes with the model's own
    segment settings)."""
    variant = TransformerXLLM(dataclasses.replace(model.config, mem_len=mem_len))
    variant.load_state_dict(model.state_dict())
    return variant.to(next(model.parameters()).device).eval()


GENERATORS = {
    "kv_cache": lambda model, prompt, n: generate_ids(model, prompt, n, greedy=True),
    "memory_only": lambda model, prompt, n: generate_ids(model, prompt, n, greedy=True, kv_cache=False),
    "recompute": generate_recompute,
}


def generation_speed(model: TransformerXLLM, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """New tokens per second, greedy: key/value cache, memory only, full recomputation of the prefix."""
    device = next(model.parameters()).device
    clock = _clock(device)
    figures, outputs = {}, {}
    for name, decode in GENERATORS.items():
        decode(model, prompt, 2)  # warm-up
        _sync(device)
        start = clock()
        outputs[name] = decode(model, prompt, new_tokens)
        _sync(device)
        figures[name] = new_tokens / (clock() - start)
    if len({tuple(ids) for ids in outputs.values()}) != 1:
        raise RuntimeError(f"the three decoders disagree: {outputs}")
    return figures


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ptb_small", help="model preset (its layers and vocabulary)")
    parser.add_argument("--lengths", default="128,256,640", help="attention lengths L, each a multiple of 4")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--segments", type=int, default=16, help="timed segments of L/4 tokens (memory)")
    parser.add_argument("--predictions", type=int, default=16, help="timed predicted tokens (sliding window)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed segments / windows first")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: steadier figures on a shared machine; GPUs ignore it)"
    )
    parser.add_argument("--attn-impl", default="auto", choices=["auto", "fused", "reference"])
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    lengths = [int(length) for length in args.lengths.split(",")]
    if any(length % 4 for length in lengths):
        parser.error(f"--lengths: every L must be a multiple of 4, got {lengths}")
    torch.manual_seed(0)
    base = preset(args.preset, dropout=0.0, dropatt=0.0, attn_impl=args.attn_impl)
    model = TransformerXLLM(base).to(device).eval()
    generator = torch.Generator().manual_seed(0)

    generating = with_mem_len(model, args.prompt_tokens + args.new_tokens)
    runs: dict[int, dict[str, list[float]]] = {length: {"memory": [], "sliding": []} for length in lengths}
    generation: dict[str, list[float]] = {name: [] for name in GENERATORS}
    for repeat in range(args.repeats):
        for length in lengths:
            segment = length // 4
            n_tokens = max((args.warmup + args.segments) * segment, length + args.warmup + args.predictions) + 1
            data = torch.randint(0, base.n_token, (args.batch, n_tokens), generator=generator).to(device)
            settings = dataclasses.replace(model.segment, mem_len=3 * length // 4)
            runs[length]["memory"].append(eval_with_memory(model, data, segment, args.warmup, settings))
            runs[length]["sliding"].append(
                eval_sliding_window(model, data, length, args.predictions, args.warmup, settings)
            )
            print(
                f"repeat {repeat + 1}/{args.repeats} L={length:5d}  memory {runs[length]['memory'][-1]:10.1f} "
                f"tokens/s   sliding window {runs[length]['sliding'][-1]:8.1f} tokens/s",
                flush=True,
            )
        prompt = torch.randint(0, base.n_token, (args.prompt_tokens,), generator=generator).tolist()
        for name, value in generation_speed(generating, prompt, args.new_tokens).items():
            generation[name].append(value)
        print(
            f"repeat {repeat + 1}/{args.repeats} generation  kv cache {generation['kv_cache'][-1]:8.1f}   memory only "
            f"{generation['memory_only'][-1]:8.1f}   recompute {generation['recompute'][-1]:8.1f} tokens/s",
            flush=True,
        )
    return _summary(args, model, lengths, runs, generation)


def _summary(
    args: argparse.Namespace, model: TransformerXLLM, lengths: list[int], runs: dict, generation: dict
) -> dict:
    """Print the medians over the repeats and return them (the JSON object of the last line)."""
    device = torch.device(args.device)
    figures: dict = {
        "preset": args.preset,
        "device": str(device),
        "batch": args.batch,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "parameters": model.num_parameters(),
        "evaluation": {},
        "generation": {},
    }
    print(f"\n{'L':>5s} {'tgt_len':>7s} {'mem_len':>7s} {'memory tok/s':>13s} {'sliding tok/s':>14s} {'speed-up':>9s}")
    for length in lengths:
        memory, sliding = runs[length]["memory"], runs[length]["sliding"]
        row = {
            "tgt_len": length // 4,
            "mem_len": 3 * length // 4,
            "memory_tokens_per_s": statistics.median(memory),
            "sliding_tokens_per_s": statistics.median(sliding),
            "speedup": statistics.median(m / s for m, s in zip(memory, sliding)),
        }
        figures["evaluation"][str(length)] = row
        print(
            f"{length:5d} {row['tgt_len']:7d} {row['mem_len']:7d} {row['memory_tokens_per_s']:13.1f} "
            f"{row['sliding_tokens_per_s']:14.1f} {row['speedup']:8.1f}x"
        )
    kv, memory, recompute = generation["kv_cache"], generation["memory_only"], generation["recompute"]
    figures["generation"] = {
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "clock": _clock(device).__name__,
        "kv_cache_tokens_per_s": statistics.median(kv),
        "memory_only_tokens_per_s": statistics.median(memory),
        "recompute_tokens_per_s": statistics.median(recompute),
        "kv_cache_over_recompute": statistics.median(a / b for a, b in zip(kv, recompute)),
        "kv_cache_over_memory_only": statistics.median(a / b for a, b in zip(kv, memory)),
        "memory_only_over_recompute": statistics.median(a / b for a, b in zip(memory, recompute)),
    }
    g = figures["generation"]
    print(
        f"generation ({args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, greedy): key/value cache "
        f"{g['kv_cache_tokens_per_s']:.1f}, memory only {g['memory_only_tokens_per_s']:.1f}, full recomputation "
        f"{g['recompute_tokens_per_s']:.1f} tokens/s; cache / recompute {g['kv_cache_over_recompute']:.1f}x, "
        f"cache / memory only {g['kv_cache_over_memory_only']:.1f}x"
    )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
