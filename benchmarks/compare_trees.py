"""Training tokens/s of several source trees of this project, side by side, in each dtype: is a change a
regression, or was the machine busier that day?

    git worktree add /tmp/old e397606
    python benchmarks/compare_trees.py /tmp/old . --precisions fp32,bf16 --steps 150 --repeats 3

Each tree trains `ptb_small` on the Penn Treebank on 2 CPU ranks (torchrun, beside this interpreter) with its own
code (PYTHONPATH=TREE), its own tokenizer and shards (each tree's data tools build them). The runs alternate,
tree by tree and dtype by dtype within a repeat, so that the machine's noise hits them alike. tokens/s is the
median of a run's logging windows after the first (start-up excluded), then the median over the repeats. The last
line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent


def _environment(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _build_data(tree: Path, work: Path) -> Path:
    """The Penn Treebank's word tokenizer and shards, built by ``tree``'s own data tools (formats change)."""
    shards = work / "shards"
    if (shards / "manifest.json").is_file():
        return shards
    tools = [
        ["data_tools.train_tokenizer", "--kind", "word", "--format", "ptb", "--output", str(work / "tokenizer")],
        ["data_tools.build_shards", "--tokenizer", str(work / "tokenizer"), "--output", str(shards), "--format", "ptb"],
    ]
    for tool in tools:
        command = [sys.executable, "-m", *tool, "--overwrite", "--no-progress"]
        subprocess.run(command, cwd=tree, env=_environment(tree), check=True, capture_output=True)
    return shards


def _tokens_per_s(tree: Path, shards: Path, output: Path, precision: str, steps: int) -> float:
    shutil.rmtree(output, ignore_errors=True)
    command = [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(random.randrange(20000, 29000)),
        "launchers/train.py",
        "--config",
        "configs/ptb_small.yaml",
        f"data.shards={shards}",
        f"train.output_dir={output}",
        f"precision.dtype={precision}",
        f"train.max_steps={steps}",
        "log.every=25",
        "eval.every=0",
        "eval.max_batches=1",
        "checkpoint.every=0",
        "schedule.total_steps=4000",  # ptb_small's schedule, whatever max_steps is
    ]
    result = subprocess.run(command, cwd=tree, env=_environment(tree), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{tree}: train.py exited {result.returncode}:\n{result.stderr[-3000:]}")
    lines = (output / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    rates = [record["tokens_per_s"] for record in map(json.loads, lines) if record.get("kind") == "train"][1:]
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (a checkout or git worktree each)")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", type=Path)
    args = parser.parse_args(argv)
    trees = [tree.resolve() for tree in args.trees]
    precisions = args.precisions.split(",")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="compare_trees."))
    shards = {tree: _build_data(tree, work / f"tree{i}") for i, tree in enumerate(trees)}
    runs: dict[tuple[int, str], list[float]] = {(i, p): [] for i in range(len(trees)) for p in precisions}
    for repeat in range(args.repeats):
        for i, tree in enumerate(trees):
            for precision in precisions:
                output = work / f"tree{i}" / f"run_{precision}"
                rate = _tokens_per_s(tree, shards[tree], output, precision, args.steps)
                runs[(i, precision)].append(rate)
                print(f"repeat {repeat}: {tree} {precision}: {rate:,.0f} tokens/s", flush=True)
    figures = {"trees": [str(t) for t in trees], "tokens_per_s": {}, "runs": {}}
    for i, tree in enumerate(trees):
        medians = {p: statistics.median(runs[(i, p)]) for p in precisions}
        ratios = "".join(f", {p}/{precisions[0]} {medians[p] / medians[precisions[0]]:.2f}x" for p in precisions[1:])
        print(f"{tree}: " + ", ".join(f"{p} {m:,.0f} tokens/s" for p, m in medians.items()) + ratios)
        figures["tokens_per_s"][str(tree)] = medians
        figures["runs"][str(tree)] = {p: runs[(i, p)] for p in precisions}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
