"""Global training throughput and peak memory per ZeRO stage and precision, on 2 CPU ranks through the deepspeed
launcher.

    python benchmarks/train_throughput.py                          # tiny_cpu and ptb_small, ZeRO 0-3, 2 repeats
    python benchmarks/train_throughput.py --configs ptb_small --stages 2,3 --steps 120 --repeats 3
    python benchmarks/train_throughput.py --configs ptb_small --stages 2 --precisions fp32,bf16 --steps 300

With several precisions the runs also compare loss curves: the largest gap between the first precision's
training loss and each other's over the logging windows, and the final validation losses (same seed, same data).

Each (config, stage) is a real run of launchers/train.py on the Penn Treebank; the variants alternate within a
repeat so that machine noise hits them alike. tokens/s is the median over the run's logging windows after the
first (start-up excluded), and so are the model's FLOPs per token and TFLOPS per rank (the trainer's figures,
docs/metrics.md); peak memory is rank 0's peak RSS (on GPUs the trainer logs max allocated instead).
Summary: medians over repeats and the ratio to ZeRO stage 0. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from training_runs import ptb_word_shards, train  # benchmarks/training_runs.py, beside this script


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    configs, stages = args.configs.split(","), [int(s) for s in args.stages.split(",")]
    precisions = args.precisions.split(",")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="train_throughput."))
    _, shards = ptb_word_shards(work / "ptb")
    variants = [(c, s, p) for c in configs for s in stages for p in precisions]
    runs: dict[tuple[str, int, str], list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for config, stage, precision in variants:
            figures = _run(
                config, stage, precision, args.steps, shards, work / f"{config}_zero{stage}_{precision}_{repeat}"
            )
            runs[(config, stage, precision)].append(figures)
            print(
                f"repeat {repeat + 1}/{args.repeats} {config:10s} ZeRO-{stage} {precision:4s} "
                f"{figures['tokens_per_s']:9.0f} tokens/s  {figures['flops_per_token']:.4g} FLOPs/token  "
                f"{figures['tflops']:.4f} TFLOPS/rank  peak RSS {figures['peak_rss_mb']:6.0f} MB  "
                f"valid loss {figures['eval_loss']:.4f}",
                flush=True,
            )
    summary = _summary(runs, variants, stages, precisions, args)
    print(json.dumps(summary))
    return summary


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny_cpu,ptb_small")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--precisions", default="fp32", help="comma-separated: fp32, bf16 (fp16 needs CUDA)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work-dir", help="where to keep shards and runs (default: a temporary folder)")
    return parser.parse_args(argv)


def _run(config: str, stage: int, precision: str, steps: int, shards: Path, out: Path) -> dict:
    """One training run's figures: tokens/s (median over the logging windows after the first), peak memory, the
    training losses and the last validation loss."""
    records = train(
        f"configs/{config}.yaml",
        shards,
        out,
        [
            f"zero.stage={stage}",
            f"precision.dtype={precision}",
            f"train.max_steps={steps}",
            f"log.every={max(1, steps // 6)}",
            "schedule.warmup_steps=1",
            "eval.every=0",
            "checkpoint.every=0",
            "log.tensorboard=false",
        ],
    )
    train_records = [r for r in records if r["kind"] == "train"]
    windows = train_records[1:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in windows),
        "flops_per_token": statistics.median(r["flops_per_token"] for r in windows),
        "tflops": statistics.median(r["tflops"] for r in windows),
        "peak_rss_mb": max(r.get("peak_rss_mb", r.get("max_allocated_mb", 0)) for r in windows),
        "losses": [r["loss"] for r in train_records],
        "eval_loss": next((r["loss"] for r in reversed(records) if r["kind"] == "eval"), None),
    }


def _summary(runs: dict, variants: list, stages: list[int], precisions: list[str], args: argparse.Namespace) -> dict:
    """Medians over the repeats and the ratios to ZeRO stage 0 and to the first precision, printed as a table."""
    summary: dict = {"ranks": 2, "device": "cpu", "steps": args.steps, "repeats": args.repeats, "results": {}}
    print(
        f"\n{'config':10s} {'stage':>5s} {'dtype':>5s} {'tokens/s':>10s} {'vs ZeRO-0':>9s} {'vs ' + precisions[0]:>9s} "
        f"{'FLOPs/token':>11s} {'TFLOPS/rank':>11s} {'peak RSS MB':>12s} {'max loss gap':>12s}"
    )
    for config, stage, precision in variants:
        results = runs[(config, stage, precision)]
        row = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "flops_per_token": statistics.median(r["flops_per_token"] for r in results),
            "tflops": statistics.median(r["tflops"] for r in results),
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results),
            "eval_loss": statistics.median(r["eval_loss"] for r in results),
        }
        if 0 in stages:
            row["vs_stage0"] = statistics.median(
                r["tokens_per_s"] / base["tokens_per_s"] for r, base in zip(results, runs[(config, 0, precision)])
            )
        if precision != precisions[0]:
            row.update(_precision_gaps(results, runs[(config, stage, precisions[0])], precisions[0]))
        summary["results"].setdefault(config, {})[f"zero{stage}_{precision}"] = row
        print(
            f"{config:10s} {stage:5d} {precision:>5s} {row['tokens_per_s']:10.0f} "
            f"{row.get('vs_stage0', float('nan')):9.2f} {row.get('vs_' + precisions[0], float('nan')):9.2f} "
            f"{row['flops_per_token']:11.4g} {row['tflops']:11.5f} "
            f"{row['peak_rss_mb']:12.0f} {row.get('max_train_loss_gap', float('nan')):12.4f}"
        )
    return summary


def _precision_gaps(results: list[dict], bases: list[dict], base_precision: str) -> dict:
    """Throughput ratio and loss gaps of one precision's runs against the first precision's, repeat by repeat."""
    return {
        f"vs_{base_precision}": statistics.median(
            r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results, bases)
        ),
        "max_train_loss_gap": max(
            abs(a - b) for r, base in zip(results, bases) for a, b in zip(r["losses"], base["losses"])
        ),
        "eval_loss_gap": statistics.median(r["eval_loss"] - b["eval_loss"] for r, b in zip(results, bases)),
    }


if __name__ == "__main__":
    main()
