"""The character benchmarks' measured figures: the byte path at enwik8's size, evaluation with the paper's long
memory against a sliding window, and a small character model trained on 2 CPU ranks.

    python benchmarks/charlm.py data --bytes 100000000          # synthetic enwik8: tokenizer, shards, reading
    python benchmarks/charlm.py eval --preset enwik8_base --tgt-len 128 --mem-len 3800 --repeats 2
    python benchmarks/charlm.py train --steps 300                # 2 CPU ranks through the deepspeed launcher

data: writes a synthetic enwik8 of --bytes (`benchmarks.corpora.synthetic_charlm`; --input takes a real one), then runs
each stage as users run it, a new process each: ``train_tokenizer --preset enwik8``, ``build_shards --format
enwik8`` with 1 and with 2 workers (alternating over --repeats), and the stream reader (rank 0 of 1 reading the
train split in enwik8_base's micro-batches of 22 x 512, benchmarks/stream_throughput.py --measure). Tokens/s
count the manifest's tokens (the file's bytes, plus one newline per split) over the wall time of the process.

eval: Transformer-XL scoring segments of --tgt-len with a memory of --mem-len (same_length, clamp_len as
enwik8's eval script: every prediction sees mem_len positions) against a vanilla Transformer's sliding window,
one forward over the --mem-len tokens before each predicted byte, on the same model (random weights: speed
only), one thread, thread CPU time. The memory is filled first (untimed segments). The paper reports up to
1,874x at 3,800 on GPUs.

train: ptb_small's layers (4 x 128) with a full softmax over the 256 bytes, tgt_len = mem_len = 128, on 2 CPU
ranks (DS_ACCELERATOR=cpu, deepspeed --num_gpus 2) over shards of a synthetic enwik8 of --train-bytes; the
logged train bpc and the final valid bpc (the file's byte unigram entropy is 4.68 bits, its bigram entropy 3.53).

Each mode ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training_runs import last_json_line, train  # benchmarks/training_runs.py, beside this script

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))  # benchmarks.corpora, run as python benchmarks/charlm.py


def _run(command: list[str], **kwargs) -> tuple[float, str]:
    """(wall seconds, standard output) of a command run to completion from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, **kwargs)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return seconds, result.stdout


def data_figures(args: argparse.Namespace) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="charlm.", dir=args.scratch))
    try:
        source = args.input if args.input is not None else _synthetic_enwik8(scratch / "enwik8", args.bytes)
        size = Path(source).stat().st_size
        seconds, _ = _run(_tokenizer_command(source, scratch / "tok"))
        figures: dict = {"bytes": size, "tokenizer_seconds": seconds, "build": {"1": [], "2": []}, "read": []}
        print(f"train_tokenizer --preset enwik8: {seconds:.1f} s ({size / seconds / 1e6:.0f} MB/s)", flush=True)
        for repeat in range(args.repeats):
            for workers in ("1", "2"):
                build = _timed_build(source, scratch / "tok", scratch / f"shards_{workers}", workers)
                figures["build"][workers].append(build)
                print(
                    f"repeat {repeat + 1}: build_shards --workers {workers}: {build['tokens']:,} tokens in "
                    f"{build['seconds']:.1f} s ({build['tokens_per_s'] / 1e6:.1f} M tokens/s; "
                    f"{build['builder_seconds']:.1f} s inside the builder)",
                    flush=True,
                )
            read = _timed_read(scratch / "shards_1", args.read_seconds)
            figures["read"].append(read)
            print(
                f"repeat {repeat + 1}: stream reading (22 x 512): {read['tokens_per_s'] / 1e6:.1f} M tokens/s, "
                f"{read['tokens_read'] / 1e6:.0f} M tokens, peak RSS {read['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
        one = [run["tokens_per_s"] for run in figures["build"]["1"]]
        two = [run["tokens_per_s"] for run in figures["build"]["2"]]
        figures["summary"] = {
            "build_1_worker_tokens_per_s": statistics.median(one),
            "build_2_workers_tokens_per_s": statistics.median(two),
            "two_over_one": statistics.median(b / a for a, b in zip(one, two)),
            "read_tokens_per_s": statistics.median(run["tokens_per_s"] for run in figures["read"]),
        }
        return figures
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _synthetic_enwik8(path: Path, size: int) -> Path:
    from benchmarks.corpora import synthetic_charlm

    started = time.perf_counter()
    source = synthetic_charlm.write_character_corpus("enwik8", path, size)
    print(f"synthetic enwik8: {source.stat().st_size:,} bytes in {time.perf_counter() - started:.1f} s", flush=True)
    return source


def _tokenizer_command(source: Path, output: Path, *extra: str) -> list[str]:
    """``train_tokenizer --preset enwik8`` over an enwik8 file."""
    return [
        sys.executable,
        "-m",
        "data_tools.train_tokenizer",
        "--preset",
        "enwik8",
        "--format",
        "enwik8",
        "--input",
        str(source),
        "--output",
        str(output),
        *extra,
        "--no-progress",
    ]


def _shards_command(source: Path, tokenizer: Path, output: Path, *extra: str) -> list[str]:
    """``build_shards --format enwik8`` over an enwik8 file."""
    return [
        sys.executable,
        "-m",
        "data_tools.build_shards",
        "--tokenizer",
        str(tokenizer),
        "--output",
        str(output),
        "--format",
        "enwik8",
        "--input",
        str(source),
        *extra,
        "--no-progress",
    ]


def _timed_build(source: Path, tokenizer: Path, output: Path, workers: str) -> dict:
    """One build of the shards: its wall and in-builder seconds, and the manifest's tokens."""
    from txl_dist.data.format import read_manifest

    seconds, stdout = _run(_shards_command(source, tokenizer, output, "--workers", workers, "--overwrite"))
    tokens = sum(split.tokens for split in read_manifest(output).splits.values())
    inside = float(re.search(r", ([\d.]+) s, [\d.]+ MB/s", stdout).group(1))
    return {"seconds": seconds, "builder_seconds": inside, "tokens": tokens, "tokens_per_s": tokens / seconds}


def _timed_read(shards: Path, seconds: float) -> dict:
    """benchmarks/stream_throughput.py --measure: rank 0 of 1 reading in enwik8_base's micro-batches."""
    command = [sys.executable, str(HERE / "stream_throughput.py"), "--measure", str(shards)]
    settings = ["--micro-batch", "22", "--tgt-len", "512", "--world-size", "1", "--seconds", str(seconds)]
    _, stdout = _run([*command, *settings])
    return last_json_line(stdout)


def eval_figures(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from eval_speed import eval_sliding_window, eval_with_memory  # benchmarks/eval_speed.py, beside this script

    from txl_dist.model import TransformerXLLM, preset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = preset(
        args.preset,
        dropout=0.0,
        dropatt=0.0,
        tgt_len=args.tgt_len,
        mem_len=args.mem_len,
        clamp_len=args.clamp_len,
        same_length=True,
    )
    model = TransformerXLLM(config).eval()
    fill = -(-args.mem_len // args.tgt_len)  # untimed segments that fill the memory
    runs: dict[str, list[float]] = {"memory": [], "sliding": []}
    generator = torch.Generator().manual_seed(0)
    for repeat in range(args.repeats):
        data = torch.randint(0, config.n_token, (1, (fill + args.segments) * args.tgt_len + 1), generator=generator)
        runs["memory"].append(eval_with_memory(model, data, args.tgt_len, fill))
        data = torch.randint(0, config.n_token, (1, args.mem_len + 1 + args.predictions), generator=generator)
        runs["sliding"].append(eval_sliding_window(model, data, args.mem_len, args.predictions, 1))
        print(
            f"repeat {repeat + 1}: memory {runs['memory'][-1]:9.1f} tokens/s, sliding window "
            f"{runs['sliding'][-1]:7.3f} tokens/s, {runs['memory'][-1] / runs['sliding'][-1]:.0f}x",
            flush=True,
        )
    return {
        "preset": args.preset,
        "parameters": model.num_parameters(),
        "tgt_len": args.tgt_len,
        "mem_len": args.mem_len,
        "clamp_len": args.clamp_len,
        "threads": 1,
        "repeats": args.repeats,
        "memory_tokens_per_s": statistics.median(runs["memory"]),
        "sliding_tokens_per_s": statistics.median(runs["sliding"]),
        "speedup": statistics.median(m / s for m, s in zip(runs["memory"], runs["sliding"])),
        "runs": runs,
    }


# The byte model of the train mode: ptb_small's layers with a full softmax over the bytes.
BYTE_MODEL = [
    "model.cutoffs=[]",
    "model.div_val=1",
    "model.tgt_len=128",
    "model.mem_len=128",
    "model.dropout=0.1",
    "model.dropatt=0.0",
]
# Evaluation at the end only, over the whole valid split, with a memory three segments long.
BYTE_EVAL = [
    "eval.every=0",
    "eval.tgt_len=128",
    "eval.mem_len=384",
    "eval.same_length=true",
    "eval.batch_size=8",
    "eval.max_batches=0",
]


def train_figures(args: argparse.Namespace) -> dict:
    from benchmarks.corpora import synthetic_charlm

    scratch = Path(tempfile.mkdtemp(prefix="charlm_train.", dir=args.scratch))
    try:
        source = synthetic_charlm.write_character_corpus("enwik8", scratch / "enwik8", args.train_bytes)
        held_out = ("--held-out-bytes", str(args.train_bytes // 20))
        _run(_tokenizer_command(source, scratch / "tok", *held_out))
        _run(_shards_command(source, scratch / "tok", scratch / "shards", *held_out))
        overrides = [
            *BYTE_MODEL,
            f"train.max_steps={args.steps}",
            "train.global_batch=16",
            f"optim.lr={args.lr}",
            "schedule.warmup_steps=20",
            *BYTE_EVAL,
            f"checkpoint.every={args.steps}",
            "log.every=25",
        ]
        started = time.perf_counter()
        metrics = train("configs/ptb_small.yaml", scratch / "shards", scratch / "run", overrides, port=args.master_port)
        seconds = time.perf_counter() - started
        train_bpc = [(m["step"], m["bpc"]) for m in metrics if m["kind"] == "train"]
        valid = [m for m in metrics if m["kind"] == "eval"][-1]
        for step, bpc in train_bpc:
            print(f"step {step:5d}  train bpc {bpc:.3f}", flush=True)
        print(f"valid bpc {valid['bpc']:.3f} over {valid['targets']:,} bytes; {seconds:.0f} s wall", flush=True)
        return {
            "train_bytes": args.train_bytes,
            "steps": args.steps,
            "seconds": seconds,
            "train_bpc": train_bpc,
            "valid_bpc": valid["bpc"],
            "valid_bytes": valid["targets"],
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics if m["kind"] == "train"),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("data", "eval", "train"))
    parser.add_argument("--scratch", default=None, help="folder for the temporary files (default: the system's)")
    parser.add_argument("--repeats", type=int, default=1)
    data = parser.add_argument_group("data")
    data.add_argument("--bytes", type=int, default=100_000_000, help="size of the synthetic enwik8")
    data.add_argument("--input", type=Path, help="an enwik8 file to use instead of a synthetic one")
    data.add_argument("--read-seconds", type=float, default=60.0, help="cap on the stream reading time")
    evaluation = parser.add_argument_group("eval")
    evaluation.add_argument("--preset", default="enwik8_base")
    evaluation.add_argument("--tgt-len", type=int, default=128)
    evaluation.add_argument("--mem-len", type=int, default=3800)
    evaluation.add_argument("--clamp-len", type=int, default=1000)
    evaluation.add_argument("--segments", type=int, default=8, help="timed segments once the memory is full")
    evaluation.add_argument("--predictions", type=int, default=3, help="timed sliding-window predictions")
    training = parser.add_argument_group("train")
    training.add_argument("--steps", type=int, default=300)
    training.add_argument("--train-bytes", type=int, default=4_000_000)
    training.add_argument(
        "--lr",
        type=float,
        default=5e-4,
        help="peak learning rate (ptb_small's 2.5e-3 keeps this byte model at the bytes' unigram "
        "entropy, 4.7 bits, for hundreds of steps; 5e-4 learns)",
    )
    training.add_argument("--master-port", type=int, default=29731)
    args = parser.parse_args(argv)
    figures = {"data": data_figures, "eval": eval_figures, "train": train_figures}[args.mode](args)
    print(json.dumps({"mode": args.mode, **figures}))
    return figures


if __name__ == "__main__":
    main()
