"""Forward + backward throughput and peak memory of the model, fused vs reference attention, side by side.

    python benchmarks/model_step.py                       # tiny and ptb_small on this machine's CPU
    python benchmarks/model_step.py --configs ptb_small --batch 32 --repeats 5
    python benchmarks/model_step.py --device cuda --configs lm1b_base --batch 28 --dtype bf16

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
    config = preset(config_name, attn_impl=impl, dropout=0.0, dropatt=0.0)
    model = TransformerXLLM(config).to(device)
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    data = torch.randint(0, config.n_token, (batch, (warmup + steps) * config.tgt_len + 1), device=device)
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    mems = None
    for step in range(warmup + steps):
        if step == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        window = slice(step * config.tgt_len, (step + 1) * config.tgt_len)
        inputs, targets = data[:, window], data[:, window.start + 1:window.stop + 1]
        with torch.autocast(device_type=device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss, mems = model(inputs, targets, mems)
        loss.mean().backward()
        model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "tokens_per_s": batch * config.tgt_len * steps / seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 1024,
        "parameters": model.num_parameters(),
    }
    if device == "cuda":
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,ptb_small", help="comma-separated model presets")
    parser.add_argument("--impls", default="reference,fused", help="attention implementations to compare")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(measure(*args.worker, args.batch, args.steps, args.warmup, args.device, args.dtype)))
        return {}

    configs, impls = args.configs.split(","), args.impls.split(",")
    runs: dict[tuple[str, str], list[dict]] = {(c, i): [] for c in configs for i in impls}
    for repeat in range(args.repeats):
        for config in configs:
            for impl in impls:
                command = [sys.executable, __file__, "--worker", config, impl, "--batch", str(args.batch),
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
                           "--dtype", args.dtype]
                out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                runs[(config, impl)].append(json.loads(out.strip().splitlines()[-1]))
                print(f"repeat {repeat + 1}/{args.repeats} {config:10s} {impl:9s} "
                      f"{runs[(config, impl)][-1]['tokens_per_s']:10.0f} tokens/s", flush=True)

    figures: dict = {"device": args.device, "dtype": args.dtype, "batch": args.batch, "repeats": args.repeats,
                     "results": {}}
    print(f"\n{'config':10s} {'attention':9s} {'tokens/s (median)':>18s} {'peak RSS MB':>12s} {'params':>10s}")
    for (config, impl), results in runs.items():
        row = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
            "step_rss_growth_mb": statistics.median(r["step_rss_growth_mb"] for r in results),
            "parameters": results[0]["parameters"],
        }
        if "peak_cuda_mb" in results[0]:
            row["peak_cuda_mb"] = statistics.median(r["peak_cuda_mb"] for r in results)
        figures["results"].setdefault(config, {})[impl] = row
        print(f"{config:10s} {impl:9s} {row['tokens_per_s']:18.0f} {row['peak_rss_mb']:12.0f} {row['parameters']:10d}")
    if "reference" in impls and "fused" in impls:
        for config in configs:
            per_repeat = [f["tokens_per_s"] / r["tokens_per_s"]
                          for f, r in zip(runs[(config, "fused")], runs[(config, "reference")])]
            figures["results"][config]["fused_over_reference"] = statistics.median(per_repeat)
            print(f"{config}: fused / reference throughput = {statistics.median(per_repeat):.3f} (median of per-repeat ratios)")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
