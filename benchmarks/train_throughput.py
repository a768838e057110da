"""Global training throughput and peak memory per ZeRO stage, on 2 CPU ranks through the deepspeed launcher.

    python benchmarks/train_throughput.py                          # tiny_cpu and ptb_small, ZeRO 0-3, 2 repeats
    python benchmarks/train_throughput.py --configs ptb_small --stages 2,3 --steps 120 --repeats 3

Each (config, stage) is a real run of launchers/train.py on the Penn Treebank; the variants alternate within a
repeat so that machine noise hits them alike. tokens/s is the median over the run's logging windows after the
first (start-up excluded); peak memory is rank 0's peak RSS (on GPUs the trainer logs max allocated instead).
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny_cpu,ptb_small")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work-dir", help="where to keep shards and runs (default: a temporary folder)")
    args = parser.parse_args(argv)

    configs, stages = args.configs.split(","), [int(s) for s in args.stages.split(",")]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="train_throughput."))
    _, shards = ptb_word_shards(work / "ptb")
    log_every = max(1, args.steps // 6)
    runs: dict[tuple[str, int], list[dict]] = {(c, s): [] for c in configs for s in stages}
    for repeat in range(args.repeats):
        for config in configs:
            for stage in stages:
                out = work / f"{config}_zero{stage}_{repeat}"
                records = train(f"configs/{config}.yaml", shards, out, [
                    f"zero.stage={stage}", f"train.max_steps={args.steps}", f"log.every={log_every}",
                    "schedule.warmup_steps=1", "eval.every=0", "checkpoint.every=0", "log.tensorboard=false"])
                windows = [r for r in records if r["kind"] == "train"][1:]
                figures = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in windows),
                           "peak_rss_mb": max(r.get("peak_rss_mb", r.get("max_allocated_mb", 0)) for r in windows)}
                runs[(config, stage)].append(figures)
                print(f"repeat {repeat + 1}/{args.repeats} {config:10s} ZeRO-{stage} "
                      f"{figures['tokens_per_s']:9.0f} tokens/s  peak RSS {figures['peak_rss_mb']:6.0f} MB", flush=True)

    summary: dict = {"ranks": 2, "device": "cpu", "steps": args.steps, "repeats": args.repeats, "results": {}}
    print(f"\n{'config':10s} {'stage':>5s} {'tokens/s':>10s} {'vs ZeRO-0':>9s} {'peak RSS MB':>12s}")
    for config in configs:
        for stage in stages:
            results = runs[(config, stage)]
            row = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                   "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in results)}
            if 0 in stages:
                row["vs_stage0"] = statistics.median(
                    r["tokens_per_s"] / base["tokens_per_s"] for r, base in zip(results, runs[(config, 0)]))
            summary["results"].setdefault(config, {})[f"zero{stage}"] = row
            print(f"{config:10s} {stage:5d} {row['tokens_per_s']:10.0f} {row.get('vs_stage0', float('nan')):9.2f} "
                  f"{row['peak_rss_mb']:12.0f}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
