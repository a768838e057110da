"""Forward + backward throughput and peak memory of the model, fused vs reference attention, side by side; or
our training step against HuggingFace's TransfoXL on the same weights and batches.

    python benchmarks/model_step.py                       # tiny and ptb_small on this machine's CPU
    python benchmarks/model_step.py --configs ptb_small --batch 32 --repeats 5
    python benchmarks/model_step.py --device cuda --configs lm1b_base --batch 28 --dtype bf16
    python benchmarks/model_step.py --compare-hf          # ours / HuggingFace 4.37.2, fp32, one thread
    python benchmarks/model_step.py --configs ptb_small --impls reference,reference+compile   # torch.compile

An attention implementation followed by "+compile" runs with model.compile (TorchInductor on the layers); its
first steps, which compile, are in the warm-up (--warmup, at least 4 then: two segment shapes, forward and
backward), and the compile time is reported apart.

Each measurement runs in a fresh process (so peak memory is that variant's alone), the variants alternate within
each repeat (so machine noise hits them alike), and the summary quotes medians and the fused/reference ratio.
The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def measure(config_name: str, impl: str, batch: int, steps: int, warmup: int, device: str, dtype: str) -> dict:
    import torch

    from txl_dist.model import TransformerXLLM, preset

    torch.manual_seed(0)
    compiled = impl.endswith("+compile")
    impl = impl.removesuffix("+compile")
    config = preset(config_name, attn_impl=impl, dropout=0.0, dropatt=0.0, compile=compiled)
    model = TransformerXLLM(config).to(device)
    if compiled:
        model.compile_body()
    if device == "cpu":
        torch.set_num_threads(1)
    clock = time.thread_time if device == "cpu" else time.perf_counter
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    data = torch.randint(0, config.n_token, (batch, (warmup + steps) * config.tgt_len + 1))
    data_host, data = data, data.to(device)
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    mems = None
    warm_start = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            warmup_seconds = time.perf_counter() - warm_start
            start = clock()
        window = slice(step * config.tgt_len, (step + 1) * config.tgt_len)
        inputs, targets = data[:, window], data[:, window.start + 1 : window.stop + 1]
        rows = model.cluster_rows(data_host[:, window.start + 1 : window.stop + 1], device)
        with torch.autocast(device_type=device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss, mems = model(inputs, targets, mems, cluster_rows=rows)
        loss.mean().backward()
        model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = clock() - start
    result = {
        "warmup_seconds": warmup_seconds,
        "tokens_per_s": batch * config.tgt_len * steps / seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 1024,
        "parameters": model.num_parameters(),
    }
    if device == "cuda":
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


# The PTB-sized model of the speed comparison with HuggingFace (issue 12): 6 layers, d_model 256, 8 heads x 32,
# d_inner 1024, a 10k vocabulary with cutoffs [2000, 5000], tgt_len = mem_len = 64.
COMPARE_MODEL = dict(
    n_token=10000,
    n_layer=6,
    d_model=256,
    n_head=8,
    d_head=32,
    d_inner=1024,
    div_val=1,
    cutoffs=[2000, 5000],
    tgt_len=64,
    mem_len=64,
    dropout=0.1,
    dropatt=0.0,
)


def compare_hf(batch: int, steps: int, warmup: int, repeats: int, threads: int, dropout: float) -> dict:
    """Training steps (forward, backward, zeroed gradients) of our model and of HuggingFace's TransfoXL with the
    same weights on the same batches, alternating step by step within one process, ``threads`` CPU threads, fp32.

    HuggingFace shifts the labels inside its forward and scores tgt_len - 1 positions per row; ours scores
    tgt_len. Throughput counts each model's own scored tokens, which favours HuggingFace by 1/tgt_len.
    With one thread the clock is this thread's CPU time (``time.thread_time``): on a shared machine it leaves
    out the time the thread waits for a core, which wall-clock time would charge to whichever model ran then."""
    import torch

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    ours, hf = _same_weights(dropout)
    tgt_len = ours.config.tgt_len
    segments = warmup + steps
    data = torch.randint(
        0, ours.config.n_token, (batch, repeats * segments * tgt_len + 1), generator=torch.Generator().manual_seed(1)
    )
    ours_runs, hf_runs = [], []
    for repeat in range(repeats):
        window = data[:, repeat * segments * tgt_len : (repeat + 1) * segments * tgt_len + 1]
        seconds = _alternating_steps(ours, hf, window, tgt_len, warmup, clock)
        ours_runs.append(batch * tgt_len * steps / seconds["ours"])
        hf_runs.append(batch * (tgt_len - 1) * steps / seconds["hf"])
        print(
            f"repeat {repeat + 1}/{repeats}: ours {ours_runs[-1]:8.0f} tokens/s   HuggingFace {hf_runs[-1]:8.0f} "
            f"tokens/s   ratio {ours_runs[-1] / hf_runs[-1]:.3f}",
            flush=True,
        )
    ratios = [o / h for o, h in zip(ours_runs, hf_runs)]
    figures = {
        "model": {**COMPARE_MODEL, "dropout": dropout},
        "batch": batch,
        "threads": threads,
        "steps": steps,
        "clock": clock.__name__,
        "alternation": "step by step",
        "repeats": repeats,
        "ours_tokens_per_s": statistics.median(ours_runs),
        "hf_tokens_per_s": statistics.median(hf_runs),
        "ours_over_hf": statistics.median(ratios),
        "ratios": ratios,
    }
    print(
        f"ours / HuggingFace TransfoXL training step: {figures['ours_over_hf']:.3f} (median of {repeats} "
        f"alternating repeats; {figures['ours_tokens_per_s']:.0f} against {figures['hf_tokens_per_s']:.0f} tokens/s)"
    )
    return figures


def _same_weights(dropout: float):
    """Our model of COMPARE_MODEL in training mode, and HuggingFace's TransfoXL holding the same weights."""
    import warnings

    import torch
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    from txl_dist.convert.hf import to_hf_config, to_hf_state_dict
    from txl_dist.model import ModelConfig, TransformerXLLM

    config = ModelConfig(**{**COMPARE_MODEL, "dropout": dropout}).validate()
    torch.manual_seed(0)
    ours = TransformerXLLM(config).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = TransfoXLLMHeadModel(TransfoXLConfig(**to_hf_config(config))).train()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), config), strict=True)
    return ours, hf


def _alternating_steps(ours, hf, data, tgt_len: int, warmup: int, clock) -> dict[str, float]:
    """Seconds of each model's timed steps over the segments of ``data`` (after ``warmup`` untimed ones).

    The two models take turns step by step (each with its own memory), so that a burst of load on the machine
    falls on both."""
    import torch

    def ours_step(inputs, targets, mems):
        loss, mems = ours(inputs, targets, mems)
        loss.mean().backward()
        ours.zero_grad(set_to_none=True)
        return mems

    def hf_step(inputs, targets, mems):
        labels = torch.cat([inputs[:, :1], targets], dim=1)[:, :-1]  # HF scores labels[:, t + 1] at t
        out = hf(input_ids=inputs, labels=labels, mems=mems)
        out.losses.mean().backward()
        hf.zero_grad(set_to_none=True)
        return out.mems

    mems = {"ours": None, "hf": None}
    seconds = {"ours": 0.0, "hf": 0.0}
    for index in range((data.size(1) - 1) // tgt_len):
        inputs = data[:, index * tgt_len : (index + 1) * tgt_len]
        targets = data[:, index * tgt_len + 1 : (index + 1) * tgt_len + 1]
        for name, step in (("ours", ours_step), ("hf", hf_step)):
            started = clock()
            mems[name] = step(inputs, targets, mems[name])
            if index >= warmup:
                seconds[name] += clock() - started
    return seconds


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    if args.compare_hf:
        figures = compare_hf(args.batch, args.steps, args.warmup, args.repeats, args.threads, args.dropout)
        print(json.dumps(figures))
        return figures

    if args.worker:
        print(json.dumps(measure(*args.worker, args.batch, args.steps, args.warmup, args.device, args.dtype)))
        return {}

    configs, impls = args.configs.split(","), args.impls.split(",")
    runs: dict[tuple[str, str], list[dict]] = {(c, i): [] for c in configs for i in impls}
    for repeat in range(args.repeats):
        for config in configs:
            for impl in impls:
                runs[(config, impl)].append(_measure_in_process(config, impl, args))
                print(
                    f"repeat {repeat + 1}/{args.repeats} {config:10s} {impl:9s} "
                    f"{runs[(config, impl)][-1]['tokens_per_s']:10.0f} tokens/s",
                    flush=True,
                )
    figures = _summary(runs, configs, impls, args)
    print(json.dumps(figures))
    return figures


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,ptb_small", help="comma-separated model presets")
    parser.add_argument("--impls", default="reference,fused", help="attention implementations to compare")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument(
        "--compare-hf",
        action="store_true",
        help="our training step against HuggingFace's TransfoXL (transformers 4.37.2) on the "
        "PTB-sized model, same weights and batches, fp32 on the CPU",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for --compare-hf")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout for --compare-hf")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "IMPL"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _measure_in_process(config: str, impl: str, args: argparse.Namespace) -> dict:
    """`measure` in a fresh process of this script, so that its peak memory is that variant's alone."""
    command = [
        sys.executable,
        __file__,
        "--worker",
        config,
        impl,
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _summary(runs: dict, configs: list[str], impls: list[str], args: argparse.Namespace) -> dict:
    """Medians over the repeats and the per-repeat ratios to the first implementation, printed as a table."""
    figures: dict = {
        "device": args.device,
        "dtype": args.dtype,
        "batch": args.batch,
        "repeats": args.repeats,
        "results": {},
    }
    print(f"\n{'config':10s} {'attention':9s} {'tokens/s (median)':>18s} {'peak RSS MB':>12s} {'params':>10s}")
    for (config, impl), results in runs.items():
        row = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
            "step_rss_growth_mb": statistics.median(r["step_rss_growth_mb"] for r in results),
            "warmup_seconds": statistics.median(r["warmup_seconds"] for r in results),
            "parameters": results[0]["parameters"],
        }
        if "peak_cuda_mb" in results[0]:
            row["peak_cuda_mb"] = statistics.median(r["peak_cuda_mb"] for r in results)
        figures["results"].setdefault(config, {})[impl] = row
        print(f"{config:10s} {impl:9s} {row['tokens_per_s']:18.0f} {row['peak_rss_mb']:12.0f} {row['parameters']:10d}")
    baseline = impls[0]
    for config in configs:
        for impl in impls[1:]:
            per_repeat = [
                v["tokens_per_s"] / b["tokens_per_s"] for v, b in zip(runs[(config, impl)], runs[(config, baseline)])
            ]
            figures["results"][config][f"{impl}_over_{baseline}"] = statistics.median(per_repeat)
            print(
                f"{config}: {impl} / {baseline} throughput = {statistics.median(per_repeat):.3f} "
                f"(median of per-repeat ratios)"
            )
    return figures


if __name__ == "__main__":
    main()
