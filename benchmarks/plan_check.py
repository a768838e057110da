"""The memory planner (`txl_dist.plan`) against the measured peaks of real runs on 2 CPU ranks.

    python benchmarks/plan_check.py                                  # the cases below, on PTB and synthetic shards
    python benchmarks/plan_check.py --cases tiny_zero2,mid_zero3 --tensor-peaks

Each case trains a few steps through the deepspeed launcher, as users run it, and compares rank 0's peak
resident memory (the trainer's ``peak_rss_mb``, which on a CPU is the device memory) with the plan for the same
config (`txl_dist.plan.plan_memory(..., device="cpu")`). With ``--tensor-peaks`` a second run of each case
records every tensor allocation with PyTorch's profiler and reports the peak of live tensor bytes, the CPU
counterpart of ``torch.cuda.max_memory_allocated``, against the plan as a GPU would count it (allocations whole,
no process term). The last line
is one JSON object of the figures.

    deepspeed --num_gpus 2 benchmarks/plan_check.py --probe OUT.json --config ... key=value ...   (one probe)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/training_runs.py, beside this script
from training_runs import launch, metrics, ptb_word_shards, run_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.corpora, run as python benchmarks/X.py

STEPS = 4

# name -> (config, overrides, shards kind). "ptb": the Penn Treebank's 10,000 words; "lm1b": a synthetic corpus
# of One Billion Word's law with a word vocabulary of about 100k.
# A 4-layer model of lm1b_base's width on the synthetic corpus's 95k words.
MID = [
    "model.n_layer=4",
    "model.d_model=512",
    "model.d_inner=2048",
    "model.n_head=8",
    "model.d_head=64",
    "model.cutoffs=[20000,40000,80000]",
    "train.global_batch=8",
]
CASES: dict[str, tuple[str, list[str], str]] = {
    "tiny_zero2": ("configs/tiny_cpu.yaml", [], "ptb"),
    "ptb_small_zero2": ("configs/ptb_small.yaml", [], "ptb"),
    "mid_zero0_fp32": ("configs/lm1b_base.yaml", [*MID, "zero.stage=0", "precision.dtype=fp32"], "lm1b"),
    "mid_zero0_bf16": ("configs/lm1b_base.yaml", [*MID, "zero.stage=0"], "lm1b"),
    "mid_zero1_bf16": ("configs/lm1b_base.yaml", [*MID, "zero.stage=1"], "lm1b"),
    "mid_zero2_bf16": ("configs/lm1b_base.yaml", MID, "lm1b"),
    "mid_zero2_fp32_mb16": (
        "configs/lm1b_base.yaml",
        [*MID, "precision.dtype=fp32", "train.global_batch=32", "model.mem_len=96"],
        "lm1b",
    ),
    "mid_zero3_bf16": (
        "configs/lm1b_base.yaml",
        [*MID, "zero.stage=3", "zero.stage3_param_persistence_threshold=0"],
        "lm1b",
    ),
    # lm1b_base itself (bf16, ZeRO-2) with a vocabulary of 935k words: 2 sequences per step, as in the issue.
    "lm1b_base_zero2": ("configs/lm1b_base.yaml", ["train.global_batch=2"], "lm1b_935k"),
}
RUN_SETTINGS = [
    f"train.max_steps={STEPS}",
    "log.every=1",
    "eval.every=0",
    "checkpoint.every=0",
    "log.tensorboard=false",
    "schedule.warmup_steps=1",
    "schedule.total_steps=1000",
    "eval.max_batches=1",
]


# ---- one probe (a rank under the deepspeed launcher) ----------------------------------------------------------


def probe(out: str, argv: list[str]) -> None:
    """Train under the profiler's memory tracking; rank r writes OUT.r.json with its peak of live tensor bytes,
    its resident memory before the model is built and its peak resident memory."""
    from torch.profiler import ProfilerActivity, profile

    from txl_dist.supervision.guard import RunGuard
    from txl_dist.training import startup
    from txl_dist.training.arguments import build_arg_parser

    parser = build_arg_parser()
    run = startup.resolve(parser, parser.parse_intermixed_args(argv))
    rank = int(os.environ.get("RANK", "0"))
    before = _rss_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        startup.start(run, RunGuard()).run()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    Path(f"{out}.{rank}.json").write_text(
        json.dumps(
            {
                "tensor_peak_bytes": peak,
                "rss_before_model_bytes": before,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )
    import torch.distributed as dist

    dist.destroy_process_group()


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- the driver -----------------------------------------------------------------------------------------------


def shards_of(kind: str, work: Path) -> Path:
    from benchmarks.corpora import synthetic_lm1b
    from data_tools import build_shards, train_tokenizer

    if kind == "ptb":
        return ptb_word_shards(work / "ptb")[1]
    # "lm1b": a flatter law than One Billion Word's over 400k ranks, the lm1b preset's vocabulary (words seen 3
    # times: 95k); "lm1b_935k": flatter still over 1.2M ranks, every word seen (935k: lm1b_base's size).
    scale, exponent, ranks, counting = {
        "lm1b": (0.01, 1.25, 400_000, ["--preset", "lm1b"]),
        "lm1b_935k": (
            0.05,
            1.2,
            1_200_000,
            ["--kind", "word", "--specials", "<S>", "</S>", "--eos", "</S>", "--unk", "<UNK>"],
        ),
    }[kind]
    home = work / kind
    shards = home / "shards"
    if not (shards / "manifest.json").is_file():
        synthetic_lm1b.write_corpus(
            home, synthetic_lm1b.CorpusShape(scale=scale, exponent=exponent, vocabulary=ranks), progress=False
        )
        source = home / synthetic_lm1b.ROOT_NAME
        train_tokenizer.main(
            [
                *counting,
                "--format",
                "lm1b",
                "--input",
                str(source),
                "--output",
                str(home / "tokenizer"),
                "--overwrite",
                "--no-progress",
                "--workers",
                "2",
            ]
        )
        build_shards.main(
            [
                "--tokenizer",
                str(home / "tokenizer"),
                "--output",
                str(shards),
                "--format",
                "lm1b",
                "--input",
                str(source),
                "--overwrite",
                "--no-progress",
                "--workers",
                "2",
            ]
        )
    return shards


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--tensor-peaks", action="store_true", help="also profile every tensor allocation")
    parser.add_argument("--work-dir", type=Path, help="where to keep shards and runs (default: a temporary folder)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    # A probe passes the trainer's command line (and the deepspeed launcher's --local_rank) on; the benchmark
    # itself refuses a flag it does not know, before minutes of runs.
    args, rest = parser.parse_known_args(argv)
    if args.probe:
        probe(args.probe, [a for a in rest if not a.startswith("--local_rank")])
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    unknown = [name for name in args.cases.split(",") if name not in CASES]
    if unknown:
        parser.error(f"--cases: no case {unknown[0]!r}; the cases: {', '.join(CASES)}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="plan_check."))
    results = {}
    for index, name in enumerate(args.cases.split(",")):
        results[name] = check_case(name, index, work, args.tensor_peaks)
        print(f"{name:22s} {json.dumps(results[name])}", flush=True)
    _print_table(results, args.tensor_peaks)
    print(json.dumps({"benchmark": "plan_check", "ranks": 2, "device": "cpu", "steps": STEPS, "results": results}))


def check_case(name: str, index: int, work: Path, tensor_peaks: bool) -> dict:
    """One case's run against its plan (and, with ``tensor_peaks``, its profiled run against the GPU plan)."""
    from txl_dist.plan import MiB, plan_memory

    config, overrides, kind = CASES[name]
    shards = shards_of(kind, work)
    output = work / "runs" / name
    # Each case starts afresh: a run left by an earlier call would resume instead of measuring a start.
    for leftover in (output, work / "runs" / f"{name}_probe_run"):
        shutil.rmtree(leftover, ignore_errors=True)
    settings = [f"data.shards={shards}", *overrides, *RUN_SETTINGS]
    started = time.perf_counter()
    launch(["launchers/train.py", "--config", config, f"train.output_dir={output}", *settings], 29700 + index)
    measured = max(r["peak_rss_mb"] for r in metrics(output) if r.get("kind") == "train") * MiB
    cfg = run_config(config, settings, shards)
    plan = plan_memory(cfg, 2, device="cpu")
    row = {
        "parameters": plan.parameters,
        "micro_batch": plan.micro_batch,
        "grad_accum": plan.grad_accum,
        "planned_mib": round(plan.peak / MiB),
        "measured_peak_rss_mib": round(measured / MiB),
        "planned_over_measured": round(plan.peak / measured, 3),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if tensor_peaks:
        out = work / "runs" / f"{name}_probe"
        script = ["benchmarks/plan_check.py", "--probe", str(out), "--config", config, f"train.output_dir={out}_run"]
        launch([*script, *settings], 29800 + index)
        probes = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]
        tensors = max(p["tensor_peak_bytes"] for p in probes)
        # Allocated bytes, as a GPU counts them (DeepSpeed's reduction bucket whole, for one).
        allocated = plan_memory(cfg, 2, device="cuda").peak
        row.update(
            {
                "planned_tensors_mib": round(allocated / MiB),
                "measured_tensor_peak_mib": round(tensors / MiB),
                "planned_over_measured_tensors": round(allocated / tensors, 3),
                "rss_before_model_mib": [round(p["rss_before_model_bytes"] / MiB) for p in probes],
            }
        )
    return row


def _print_table(results: dict[str, dict], tensor_peaks: bool) -> None:
    print(
        f"\n{'case':22s} {'params':>12s} {'planned MiB':>12s} {'peak RSS MiB':>13s} {'ratio':>7s}"
        + (f" {'plan tensors':>13s} {'tensor peak':>12s} {'ratio':>7s}" if tensor_peaks else "")
    )
    for name, row in results.items():
        line = (
            f"{name:22s} {row['parameters']:12,d} {row['planned_mib']:12d} {row['measured_peak_rss_mib']:13d} "
            f"{row['planned_over_measured']:7.2f}"
        )
        if tensor_peaks:
            line += (
                f" {row['planned_tensors_mib']:13d} {row['measured_tensor_peak_mib']:12d} "
                f"{row['planned_over_measured_tensors']:7.2f}"
            )
        print(line)


if __name__ == "__main__":
    main()
