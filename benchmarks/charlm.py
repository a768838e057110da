"""The character benchmarks' measured figures: the byte path at enwik8's size, evaluation with the paper's long
memory against a sliding window, and a small character model trained on 2 CPU ranks.

    python benchmarks/charlm.py data --bytes 100000000          # synthetic enwik8: tokenizer, shards, reading
    python benchmarks/charlm.py eval --preset enwik8_base --tgt-len 128 --mem-len 3800 --repeats 2
    python benchmarks/charlm.py train --steps 300                # 2 CPU ranks through the deepspeed launcher

data: writes a synthetic enwik8 of --bytes (`data_tools.synthetic_charlm`; --input takes a real one), then runs
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

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


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
    from data_tools import synthetic_charlm
    from txl_dist.data.format import read_manifest

    scratch = Path(tempfile.mkdtemp(prefix="charlm.", dir=args.scratch))
    try:
        source = args.input
        if source is None:
            started = time.perf_counter()
            source = synthetic_charlm.write_character_corpus("enwik8", scratch / "enwik8", args.bytes)
            print(
                f"synthetic enwik8: {source.stat().st_size:,} bytes in {time.perf_counter() - started:.1f} s",
                flush=True,
            )
        size = Path(source).stat().st_size
        seconds, _ = _run(
            [
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
                str(scratch / "tok"),
                "--no-progress",
            ]
        )
        figures: dict = {"bytes": size, "tokenizer_seconds": seconds, "build": {"1": [], "2": []}, "read": []}
        print(f"train_tokenizer --preset enwik8: {seconds:.1f} s ({size / seconds / 1e6:.0f} MB/s)", flush=True)
        for repeat in range(args.repeats):
            for workers in ("1", "2"):
                output = scratch / f"shards_{workers}"
                seconds, stdout = _run(
                    [
                        sys.executable,
                        "-m",
                        "data_tools.build_shards",
                        "--tokenizer",
                        str(scratch / "tok"),
                        "--output",
                        str(output),
                        "--format",
                        "enwik8",
                        "--input",
                        str(source),
                        "--workers",
                        workers,
                        "--overwrite",
                        "--no-progress",
                    ]
                )
                manifest = read_manifest(output)
                tokens = sum(split.tokens for split in manifest.splits.values())
                inside = float(re.search(r", ([\d.]+) s, [\d.]+ MB/s", stdout).group(1))
                figures["build"][workers].append(
                    {"seconds": seconds, "builder_seconds": inside, "tokens": tokens, "tokens_per_s": tokens / seconds}
                )
                print(
                    f"repeat {repeat + 1}: build_shards --workers {workers}: {tokens:,} tokens in {seconds:.1f} s "
                    f"({tokens / seconds / 1e6:.1f} M tokens/s; {inside:.1f} s inside the builder)",
                    flush=True,
                )
            _, stdout = _run(
                [
                    sys.executable,
                    str(HERE / "stream_throughput.py"),
                    "--measure",
                    str(scratch / "shards_1"),
                    "--micro-batch",
                    "22",
                    "--tgt-len",
                    "512",
                    "--world-size",
                    "1",
                    "--seconds",
                    str(args.read_seconds),
                ]
            )
            read = json.loads(stdout.strip().splitlines()[-1])
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


def train_figures(args: argparse.Namespace) -> dict:
    from data_tools import synthetic_charlm

    scratch = Path(tempfile.mkdtemp(prefix="charlm_train.", dir=args.scratch))
    try:
        source = synthetic_charlm.write_character_corpus("enwik8", scratch / "enwik8", args.train_bytes)
        held_out = str(args.train_bytes // 20)
        _run(
            [
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
                str(scratch / "tok"),
                "--held-out-bytes",
                held_out,
                "--no-progress",
            ]
        )
        _run(
            [
                sys.executable,
                "-m",
                "data_tools.build_shards",
                "--tokenizer",
                str(scratch / "tok"),
                "--output",
                str(scratch / "shards"),
                "--format",
                "enwik8",
                "--input",
                str(source),
                "--held-out-bytes",
                held_out,
                "--no-progress",
            ]
        )
        deepspeed = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
        run_dir = scratch / "run"
        command = [
            deepspeed,
            "--num_gpus",
            "2",
            "--master_port",
            str(args.master_port),
            "launchers/train.py",
            "--config",
            "configs/ptb_small.yaml",
            f"data.shards={scratch / 'shards'}",
            f"train.output_dir={run_dir}",
            "model.cutoffs=[]",
            "model.div_val=1",
            "model.tgt_len=128",
            "model.mem_len=128",
            "model.dropout=0.1",
            "model.dropatt=0.0",
            f"train.max_steps={args.steps}",
            "train.global_batch=16",
            f"optim.lr={args.lr}",
            "schedule.warmup_steps=20",
            "eval.every=0",
            "eval.tgt_len=128",
            "eval.mem_len=384",
            "eval.same_length=true",
            "eval.batch_size=8",
            "eval.max_batches=0",
            f"checkpoint.every={args.steps}",
            "log.every=25",
        ]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        started = time.perf_counter()
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            raise SystemExit(f"training exited {result.returncode}:\n{(result.stdout + result.stderr)[-4000:]}")
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [(m["step"], m["bpc"]) for m in metrics if m["kind"] == "train"]
        valid = [m for m in metrics if m["kind"] == "eval"][-1]
        for step, bpc in train:
            print(f"step {step:5d}  train bpc {bpc:.3f}", flush=True)
        print(f"valid bpc {valid['bpc']:.3f} over {valid['targets']:,} bytes; {seconds:.0f} s wall", flush=True)
        tokens_per_s = [m["tokens_per_s"] for m in metrics if m["kind"] == "train"]
        return {
            "train_bytes": args.train_bytes,
            "steps": args.steps,
            "seconds": seconds,
            "train_bpc": train,
            "valid_bpc": valid["bpc"],
            "valid_bytes": valid["targets"],
            "tokens_per_s": statistics.median(tokens_per_s),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{args.master_port}_*"):
            buffer.unlink(missing_ok=True)


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
