"""The paper's central claim at small scale: the same model trained with a memory (mem_len = tgt_len) and without
(mem_len = 0, a vanilla Transformer on fixed segments), for the same steps on the Penn Treebank.

    python benchmarks/memory_ablation.py                              # ptb_small, 3000 steps each, 2 CPU ranks
    python benchmarks/memory_ablation.py --steps 1000 --config configs/tiny_cpu.yaml

Both runs use the same config, seed and data order; only model.mem_len differs. Each model is then evaluated on
the validation and test splits with its own settings: the vanilla model with mem_len 0 (each segment alone), the
recurrent one with its training memory and with the config's evaluation memory. The last line is one JSON object
of the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from training_runs import evaluate, ptb_word_shards, train  # benchmarks/training_runs.py, beside this script


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/ptb_small.yaml")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--work-dir", help="where to keep shards and runs (default: a temporary folder)")
    args = parser.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="memory_ablation."))
    _, shards = ptb_word_shards(work / "ptb")
    from txl_dist.config import load_config

    cfg = load_config(args.config, [])
    tgt_len = cfg.model.tgt_len
    eval_mem = cfg.eval.mem_len if cfg.eval.mem_len is not None else cfg.model.mem_len
    variants = {"memory": tgt_len, "vanilla": 0}
    summary: dict = {"config": args.config, "steps": args.steps, "tgt_len": tgt_len, "results": {}}
    for name, mem_len in variants.items():
        out = work / name
        train(
            args.config,
            shards,
            out,
            [
                f"model.mem_len={mem_len}",
                f"train.max_steps={args.steps}",
                "eval.every=0",
                "checkpoint.every=0",
                "log.every=100",
            ],
        )
        settings = {"own": ["--mem-len", str(mem_len), "--tgt-len", str(tgt_len)]}
        if mem_len:
            settings["eval_config"] = ["--mem-len", str(eval_mem), "--tgt-len", str(cfg.eval.tgt_len or tgt_len)]
        results = {}
        for label, extra in settings.items():
            for split in ("valid", "test"):
                result = evaluate(out, split, f"{split}_{label}", *extra)
                results[f"{split}_{label}"] = {
                    "ppl": result["ppl"],
                    "mem_len": result["settings"]["mem_len"],
                    "tgt_len": result["settings"]["tgt_len"],
                }
                print(
                    f"{name:8s} ({label:11s} mem_len {result['settings']['mem_len']:3d}): {split} ppl "
                    f"{result['ppl']:8.2f}",
                    flush=True,
                )
        summary["results"][name] = results
    memory, vanilla = summary["results"]["memory"], summary["results"]["vanilla"]
    summary["valid_ppl_ratio_vanilla_over_memory"] = vanilla["valid_own"]["ppl"] / memory["valid_own"]["ppl"]
    print(
        f"valid ppl: memory {memory['valid_own']['ppl']:.2f} vs vanilla {vanilla['valid_own']['ppl']:.2f} "
        f"(ratio {summary['valid_ppl_ratio_vanilla_over_memory']:.3f})"
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
