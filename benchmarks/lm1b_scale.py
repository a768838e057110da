"""Every stage of the pipeline at One Billion Word's scale, on a synthetic corpus of its layout and statistics.

    python benchmarks/lm1b_scale.py --scale 1.0 --work-dir /tmp/lm1b_scale          # the full shape (~3.2 GB)
    python benchmarks/lm1b_scale.py --scale 0.01 --train-steps 2                     # a rehearsal in minutes
    python benchmarks/lm1b_scale.py --scale 1.0 --corpus /tmp/lm1b_scale/corpus --repo /tmp/old_checkout \\
        --skip-training --tokenizer-workers 1                                        # "before": another checkout

Stages, each a new process as users run it (the data tools and the training launcher of ``--repo``, default
this checkout), timed by wall clock, with the peak resident memory summed over the stage's processes (parent and
workers, sampled every 50 ms):

1. corpus: `benchmarks.corpora.synthetic_lm1b` writes 99 training and 50 heldout files at ``--scale`` (1.0 = 30.3M
   sentences, 0.8B tokens), or ``--corpus`` reuses one;
2. vocabulary: ``train_tokenizer --preset lm1b --format lm1b`` with ``--tokenizer-workers`` processes;
3. shards: ``build_shards --format lm1b`` with 1 and with ``--workers`` workers (their shards must be
   byte-identical);
4. stream reading: `txl_dist.data.TrainStreams` over the training shards, rank 0 of 2 with lm1b_base's
   segments, for ``--stream-seconds``;
5. training: ``--train-steps`` steps of ``--train-config`` (default lm1b_base, bf16, ZeRO-2) on 2 CPU ranks through
   the deepspeed launcher, stopped by SIGTERM (it checkpoints), with its memory plan (`txl_dist.plan`) beside
   the measured peak.

Targets (the issue's, for the full shape on 2 cores): vocabulary <= 90 s and shards <= 90 s, each at most 2 GB of
peak memory; 2 shard workers >= 1.7x one, each >= 25 MB/s. The last line is one JSON object of the figures. The
corpus and the runs stay in ``--work-dir`` unless ``--clean`` (a temporary folder is always removed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

# benchmarks/training_runs.py, beside this script
from training_runs import DEEPSPEED, remove_allreduce_buffers, run_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.corpora, run as python benchmarks/lm1b_scale.py
PYTHON = sys.executable


class Measured:
    """Wall time, the peak of the summed resident memory of a process tree (sampled every 50 ms), and the CPU
    time of all its processes."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        cwd: Path,
        stop_when: Callable[[], bool] | None = None,
        memory_limit: int | None = None,
    ):
        """Run ``command``; with ``stop_when``, SIGTERM the processes started with --local_rank (training
        ranks) once it holds: they checkpoint and exit at the end of their step. With ``memory_limit`` (bytes),
        kill every process of the command once they hold more in all (``killed_at_rss`` records it)."""
        self.killed_at_rss: int | None = None
        self.command = command
        self.peak_rss = 0
        self._stop_when, self._memory_limit, self._stopped = stop_when, memory_limit, False
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done = threading.Event()
        sampler = threading.Thread(target=self._sample, args=(psutil.Process(process.pid), done), daemon=True)
        sampler.start()
        self.stdout, self.stderr = process.communicate()
        done.set()
        sampler.join()
        self.seconds = time.perf_counter() - started
        # Every process of the command was waited for (workers by their parent, ranks by the launcher), so the
        # CPU time of all of them is in this process's children's usage.
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.cpu_seconds = children.ru_utime + children.ru_stime - children_before.ru_utime - children_before.ru_stime
        if process.returncode != 0 and self.killed_at_rss is None:
            raise RuntimeError(f"{' '.join(command)} exited {process.returncode}:\n{self.stderr[-3000:]}")

    def _sample(self, root: psutil.Process, done: threading.Event) -> None:
        """Every 50 ms until ``done``: the summed resident memory of the tree, and the stop and memory rules."""
        while not done.is_set():
            try:
                members = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            if self._stop_when is not None and not self._stopped and self._stop_when():
                self._stopped = True
                for member in members:
                    try:
                        if any(a.startswith("--local_rank") for a in member.cmdline()):
                            member.send_signal(signal.SIGTERM)
                    except psutil.NoSuchProcess:
                        pass
            total = 0
            for member in members:
                try:
                    total += member.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.peak_rss = max(self.peak_rss, total)
            if self._memory_limit is not None and total > self._memory_limit and self.killed_at_rss is None:
                self.killed_at_rss = total
                for member in reversed(members):
                    try:
                        member.kill()
                    except psutil.NoSuchProcess:
                        pass
            done.wait(0.05)

    def figures(self, megabytes: float | None = None, tokens: int | None = None) -> dict:
        out = {
            "seconds": round(self.seconds, 1),
            "peak_rss_mib": round(self.peak_rss / 2**20),
            "cpu_seconds": round(self.cpu_seconds, 1),
            "cpu_percent": round(100 * self.cpu_seconds / max(self.seconds, 1e-9)),
        }
        if megabytes is not None:
            out["mb_per_s"] = round(megabytes / self.seconds, 2)
            # What one core does when it is not shared: robust to other jobs on the machine.
            out["mb_per_cpu_second"] = round(megabytes / max(self.cpu_seconds, 1e-9), 2)
        if tokens is not None:
            out["tokens_per_s"] = round(tokens / self.seconds)
        return out


def environment(repo: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(repo), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def corpus_stage(args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    from benchmarks.corpora import synthetic_lm1b

    if args.corpus is not None:
        root = args.corpus / synthetic_lm1b.ROOT_NAME
        statistics = json.loads((root / "synthetic.json").read_text())
        return root, {
            "reused": str(root),
            **{k: statistics[k] for k in ("train_bytes", "train_sentences", "train_words")},
        }
    run = Measured(
        [
            PYTHON,
            "-m",
            "benchmarks.corpora.synthetic_lm1b",
            "--output",
            str(work / "corpus"),
            "--scale",
            str(args.scale),
            "--seed",
            str(args.seed),
            "--workers",
            str(args.workers),
            "--no-progress",
        ],
        environment(REPO),
        REPO,
    )
    root = work / "corpus" / synthetic_lm1b.ROOT_NAME
    statistics = json.loads((root / "synthetic.json").read_text())
    return root, {
        **run.figures(statistics["train_bytes"] / 1e6),
        **{k: statistics[k] for k in ("train_bytes", "train_sentences", "train_words")},
    }


def vocabulary_stage(args: argparse.Namespace, root: Path, work: Path, megabytes: float) -> tuple[Path, dict]:
    tokenizer = work / "tokenizer"
    command = [
        PYTHON,
        "-m",
        "data_tools.train_tokenizer",
        "--preset",
        "lm1b",
        "--format",
        "lm1b",
        "--input",
        str(root),
        "--output",
        str(tokenizer),
        "--overwrite",
        "--no-progress",
    ]
    if args.tokenizer_workers != 1:  # an older checkout has no --workers
        command += ["--workers", str(args.tokenizer_workers)]
    run = Measured(command, environment(args.repo), args.repo)
    vocabulary = json.loads((tokenizer / "tokenizer.json").read_text())["vocab_size"]
    return tokenizer, {**run.figures(megabytes), "workers": args.tokenizer_workers, "vocab_size": vocabulary}


SUMMARY = re.compile(r"build_shards: ([\d,]+) documents, ([\d,]+) tokens")


def shards_stage(
    args: argparse.Namespace, root: Path, tokenizer: Path, work: Path, megabytes: float
) -> tuple[Path, dict]:
    figures, outputs = {}, {}
    for workers in sorted({1, args.workers}):
        output = work / f"shards_{workers}"
        run = Measured(
            [
                PYTHON,
                "-m",
                "data_tools.build_shards",
                "--tokenizer",
                str(tokenizer),
                "--output",
                str(output),
                "--format",
                "lm1b",
                "--input",
                str(root),
                "--workers",
                str(workers),
                "--overwrite",
                "--no-progress",
            ],
            environment(args.repo),
            args.repo,
        )
        match = SUMMARY.search(run.stdout)
        tokens = int(match.group(2).replace(",", ""))
        # Input bytes: the training file's and the two heldout files'.
        figures[f"workers{workers}"] = {**run.figures(megabytes, tokens), "tokens": tokens}
        outputs[workers] = output
    if args.workers != 1:
        one, many = (figures[f"workers{w}"] for w in (1, args.workers))
        figures[f"speedup_{args.workers}_over_1"] = round(one["seconds"] / many["seconds"], 3)
        figures[f"mb_per_s_per_worker_{args.workers}"] = round(many["mb_per_s"] / args.workers, 2)
        same = all(
            (outputs[1] / p.name).read_bytes() == p.read_bytes() for p in sorted(outputs[args.workers].glob("*.tar"))
        )
        figures["identical_shards"] = same and (
            sorted(p.name for p in outputs[1].glob("*.tar"))
            == sorted(p.name for p in outputs[args.workers].glob("*.tar"))
        )
        shutil.rmtree(outputs[1])
    return outputs[args.workers], figures


STREAM_PROGRAM = """
import json, resource, sys, time
from txl_dist.data import TrainStreams
shards, seconds, micro_batch, tgt_len = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
started = time.perf_counter()
streams = TrainStreams(shards, "train", tgt_len=tgt_len, micro_batch=micro_batch, grad_accum=1, world_size=2, rank=0,
                       seed=1, shuffle_blocks=True, verify_sha256=False)
opened = time.perf_counter() - started
batches = iter(streams)
count, started = 0, time.perf_counter()
while time.perf_counter() - started < seconds:
    next(batches)
    count += 1
elapsed = time.perf_counter() - started
print(json.dumps({"open_seconds": opened, "tokens_per_s": count * micro_batch * tgt_len / elapsed,
                  "batches": count, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def stream_stage(args: argparse.Namespace, shards: Path) -> dict:
    run = Measured(
        [PYTHON, "-c", STREAM_PROGRAM, str(shards), str(args.stream_seconds), "112", "32"],
        environment(args.repo),
        args.repo,
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    return {
        "tokens_per_s": round(measured["tokens_per_s"]),
        "open_seconds": round(measured["open_seconds"], 2),
        "peak_rss_mib": round(measured["peak_rss_mib"]),
        "micro_batch": 112,
        "tgt_len": 32,
        "rank": "0 of 2, blocks shuffled",
    }


def training_stage(args: argparse.Namespace, shards: Path, work: Path) -> dict:
    output = work / "train"
    shutil.rmtree(output, ignore_errors=True)
    # The run is stopped by SIGTERM after --train-steps steps: at max_steps the trainer would evaluate the
    # whole valid split (160k tokens), which takes lm1b_base half an hour on 2 CPU cores.
    overrides = [
        f"data.shards={shards}",
        f"train.output_dir={output}",
        "train.max_steps=1000000",
        "train.global_batch=2",
        "log.every=1",
        "eval.every=0",
        "checkpoint.every=0",
        "log.tensorboard=false",
        "schedule.warmup_steps=1",
        "data.verify_sha256=false",
        *args.train_overrides,
    ]
    command = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(args.port), "launchers/train.py"]
    command += ["--config", args.train_config, *overrides]
    metrics = output / "metrics.jsonl"

    def enough_steps() -> bool:
        return metrics.is_file() and metrics.read_text().count('"kind": "train"') >= args.train_steps

    limit = None if args.memory_limit is None else int(args.memory_limit * 2**30)
    try:
        run = Measured(command, environment(args.repo), args.repo, stop_when=enough_steps, memory_limit=limit)
    finally:
        remove_allreduce_buffers(args.port)
    if run.killed_at_rss is not None:
        return _killed_figures(args, run, metrics)
    figures = _training_figures(args, run, metrics)
    if args.repo == REPO:
        figures.update(_planned_figures(args.train_config, overrides, shards, figures["peak_rss_mib_rank0"]))
    return figures


def _killed_figures(args: argparse.Namespace, run: Measured, metrics: Path) -> dict:
    """What a training stage killed at --memory-limit got to."""
    log = [line for line in (run.stdout + run.stderr).splitlines() if "[rank" in line or "Time to load" in line]
    return {
        "config": args.train_config,
        "overrides": args.train_overrides,
        "killed_at_rss_mib_all_processes": round(run.killed_at_rss / 2**20),
        "memory_limit_gib": args.memory_limit,
        "seconds_until_killed": round(run.seconds, 1),
        "steps_done": metrics.read_text().count('"kind": "train"') if metrics.is_file() else 0,
        "last_log_lines": log[-4:],
    }


def _training_figures(args: argparse.Namespace, run: Measured, metrics: Path) -> dict:
    """Step time, throughput and memory over the first --train-steps steps of the run's metrics."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"][: args.train_steps]
    later = steps[1:] or steps  # the first step includes the warm-up of every kernel
    figures = {
        "config": args.train_config,
        "steps": len(steps),
        "ranks": 2,
        "seconds_per_step": round(sum(r["step_time_s"] for r in later) / len(later), 2),
        "tokens_per_s": round(sum(r["tokens_per_s"] for r in later) / len(later), 1),
        "peak_rss_mib_rank0": round(max(r["peak_rss_mb"] for r in steps)),
        "peak_rss_mib_all_processes": round(run.peak_rss / 2**20),
        "wall_seconds": round(run.seconds, 1),
        "loss_first_last": [round(steps[0]["loss"], 3), round(steps[-1]["loss"], 3)],
    }
    match = re.search(r"training (\S+) \((\d+) parameters\)", run.stderr + run.stdout)
    if match:
        figures["parameters"] = int(match.group(2))
    return figures


def _planned_figures(config: str, overrides: list[str], shards: Path, measured_mib: int) -> dict:
    """The memory plan (`txl_dist.plan`) of the run's config, against rank 0's measured peak."""
    from txl_dist.plan import MiB, plan_memory

    planned = plan_memory(run_config(config, overrides, shards), 2, device="cpu").peak
    return {"planned_peak_mib": round(planned / MiB), "planned_over_measured": round(planned / (measured_mib * MiB), 3)}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="1.0: One Billion Word's size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="shard workers (and corpus writers) besides 1")
    parser.add_argument("--tokenizer-workers", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, help="keeps the corpus and outputs (default: a temporary folder)")
    parser.add_argument("--corpus", type=Path, help="reuse a corpus written by an earlier run (its --work-dir/corpus)")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout whose tools are measured")
    parser.add_argument("--stream-seconds", type=float, default=20.0)
    parser.add_argument("--train-config", default="configs/lm1b_base.yaml")
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--train-overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument(
        "--train-only",
        type=Path,
        metavar="SHARDS",
        help="only the training stage, on these shards (e.g. lm1b_large with ZeRO-3 and offload)",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        metavar="GiB",
        help="kill the training stage once its processes hold this much memory in all",
    )
    parser.add_argument("--port", type=int, default=29671)
    parser.add_argument("--clean", action="store_true", help="remove the work dir's corpus and outputs at the end")
    args = parser.parse_args(argv)
    args.repo = args.repo.resolve()
    return args


def _all_stages(args: argparse.Namespace, work: Path, results: dict) -> None:
    root, results["corpus"] = corpus_stage(args, work)
    megabytes = (results["corpus"]["train_bytes"]) / 1e6
    print(f"corpus: {json.dumps(results['corpus'])}", flush=True)
    tokenizer, results["vocabulary"] = vocabulary_stage(args, root, work, megabytes)
    print(f"vocabulary: {json.dumps(results['vocabulary'])}", flush=True)
    # The shard builder reads the heldout files too (valid and test): its MB/s counts them.
    heldout = sum(
        p.stat().st_size
        for p in (root / "heldout-monolingual.tokenized.shuffled").iterdir()
        if p.name.endswith(("00000-of-00050", "00001-of-00050"))
    )
    shards, results["shards"] = shards_stage(args, root, tokenizer, work, megabytes + heldout / 1e6)
    print(f"shards: {json.dumps(results['shards'])}", flush=True)
    results["streams"] = stream_stage(args, shards)
    print(f"streams: {json.dumps(results['streams'])}", flush=True)
    if not args.skip_training:
        results["training"] = training_stage(args, shards, work)
        print(f"training: {json.dumps(results['training'])}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    temporary = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="lm1b_scale.")) if temporary else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "benchmark": "lm1b_scale",
        "scale": args.scale,
        "repo": str(args.repo),
        "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg()[0],
    }
    if args.train_only is not None:
        results["training"] = training_stage(args, args.train_only.resolve(), work)
        print(json.dumps(results))
        return results
    try:
        _all_stages(args, work, results)
    finally:
        if temporary or args.clean:
            for name in ("corpus", "tokenizer", "train", *(p.name for p in work.glob("shards_*"))):
                if args.corpus is None or name != "corpus":
                    shutil.rmtree(work / name, ignore_errors=True)
            if temporary:
                shutil.rmtree(work, ignore_errors=True)
    results["load_average_end"] = os.getloadavg()[0]
    targets = {
        "vocabulary_seconds<=90": results["vocabulary"]["seconds"] <= 90,
        "vocabulary_peak_rss<=2GB": results["vocabulary"]["peak_rss_mib"] <= 2e9 / 2**20,
    }
    shard_figures = results["shards"].get(f"workers{args.workers}", {})
    targets.update(
        {
            "shards_seconds<=90": shard_figures.get("seconds", 1e9) <= 90,
            "shards_peak_rss<=2GB": shard_figures.get("peak_rss_mib", 1e9) <= 2e9 / 2**20,
        }
    )
    if args.workers == 2:
        targets["speedup_2_over_1>=1.7"] = results["shards"]["speedup_2_over_1"] >= 1.7
        targets["mb_per_s_per_worker>=25"] = results["shards"]["mb_per_s_per_worker_2"] >= 25
    results["targets_met"] = targets
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
