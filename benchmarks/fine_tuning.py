"""What starting from a trained model buys: a small Transformer-XL pretrained on one corpus and fine-tuned on
another (train.init_from), against the same model trained on the second from scratch for the same steps.

    python benchmarks/fine_tuning.py --work /tmp/fine_tuning            # ~8 minutes on 2 CPU cores
    python benchmarks/fine_tuning.py --work /tmp/fine_tuning --pretrain-steps 4000 --steps 500

The two corpora come from the Penn Treebank (the `treebank` package), cut by topic: the second ("banking") is
every sentence that names a bank, a loan, savings, a thrift, deposits, lending or a mortgage (1,903 sentences of
train, 50k tokens; its valid and test sentences are held out likewise); the first is the rest of PTB (40k
sentences). One word tokenizer (PTB's 10k words) serves both, as fine-tuning needs. The model is configs/
ptb_small.yaml's (2.1M parameters) on 2 CPU ranks through the deepspeed launcher:

1. pretrain on the first corpus (`--pretrain-steps`), export it;
2. fine-tune it on the banking sentences for `--steps` steps (configs/finetune_cpu.yaml, global batch 32 as in
   pretraining, its lower learning rate) and, side by side, train the same model from scratch on them for the
   same steps (configs/ptb_small.yaml, its own learning rate);
3. score the banking test sentences with each (launchers/evaluate.py --text): the pretrained model as it is,
   the fine-tuned and the from-scratch run.

Prints one line per model (test perplexity, training wall time) and the ratio of the perplexities.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOPIC = {"bank", "banks", "banking", "loan", "loans", "savings", "thrift", "thrifts", "deposits", "lending"}
TOPIC |= {"mortgage", "mortgages"}
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _run(*command: str) -> float:
    """Run a command from the repository root; its wall time in seconds. A failure ends the benchmark."""
    began = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")
    return time.perf_counter() - began


def _python(*args: str) -> float:
    return _run(sys.executable, *args)


def _deepspeed(*args: str) -> float:
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    return _run(deepspeed, "--num_gpus", "2", "launchers/train.py", *args)


def _corpora(work: Path) -> None:
    import treebank

    for split in ("train", "valid", "test"):
        lines = [line.strip() for line in treebank.penn[split].split("\n") if line.strip()]
        topical = [line for line in lines if TOPIC & set(line.split())]
        rest = [line for line in lines if not TOPIC & set(line.split())]
        (work / f"general_{split}.txt").write_text("".join(line + "\n" for line in rest))
        (work / f"banking_{split}.txt").write_text("".join(line + "\n" for line in topical))


def _ppl(work: Path, model: Path) -> float:
    out = work / f"score_{model.name}.json"
    _python(
        "launchers/evaluate.py",
        str(model),
        "--text",
        str(work / "banking_test.txt"),
        "--output",
        str(out),
        "--no-progress",
    )
    return json.loads(out.read_text())["ppl"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a folder for the corpora, shards and runs (wiped)")
    parser.add_argument("--pretrain-steps", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning and from-scratch steps")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _corpora(work)
    tokenizer = work / "tokenizer"
    _python(
        "-m",
        "data_tools.train_tokenizer",
        "--kind",
        "word",
        "--format",
        "ptb",
        "--output",
        str(tokenizer),
        "--no-progress",
    )
    for corpus in ("general", "banking"):
        splits = [f"--split={split}={work / f'{corpus}_{split}.txt'}" for split in ("train", "valid")]
        _python(
            "-m",
            "data_tools.build_shards",
            "--tokenizer",
            str(tokenizer),
            "--output",
            str(work / f"{corpus}_shards"),
            *splits,
            "--no-progress",
        )

    pretrain = _deepspeed(
        "--config",
        "configs/ptb_small.yaml",
        f"data.shards={work / 'general_shards'}",
        f"train.output_dir={work / 'pretrained'}",
        f"train.max_steps={args.pretrain_steps}",
        "eval.every=0",
        "checkpoint.every=0",
    )
    _python("launchers/convert.py", "zero-to-export", str(work / "pretrained"), str(work / "pretrained_export"))
    same = [
        f"data.shards={work / 'banking_shards'}",
        f"train.max_steps={args.steps}",
        "train.global_batch=32",
        "train.micro_batch=16",
        "eval.every=0",
        "checkpoint.every=0",
    ]
    tuned = _deepspeed(
        "--config",
        "configs/finetune_cpu.yaml",
        *same,
        f"train.output_dir={work / 'fine_tuned'}",
        f"train.init_from={work / 'pretrained_export'}",
    )
    scratch = _deepspeed(
        "--config",
        "configs/ptb_small.yaml",
        *same,
        f"train.output_dir={work / 'from_scratch'}",
        "schedule.warmup_steps=30",
    )
    scores = {name: _ppl(work, work / name) for name in ("pretrained_export", "fine_tuned", "from_scratch")}
    print(f"banking test ({sum(1 for _ in open(work / 'banking_test.txt'))} sentences), perplexity:")
    print(
        f"  pretrained on the rest of PTB ({args.pretrain_steps} steps, {pretrain:.0f} s), as it is: "
        f"{scores['pretrained_export']:.1f}"
    )
    print(f"  fine-tuned from it, {args.steps} steps ({tuned:.0f} s): {scores['fine_tuned']:.1f}")
    print(f"  from scratch, {args.steps} steps ({scratch:.0f} s): {scores['from_scratch']:.1f}")
    print(f"  from scratch / fine-tuned: {scores['from_scratch'] / scores['fine_tuned']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
