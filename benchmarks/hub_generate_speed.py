"""Generation speed of an export-to-hub folder in current transformers against txl_dist.generate, same model.

    python benchmarks/hub_generate_speed.py                          # ptb_small with random weights, on this CPU
    python benchmarks/hub_generate_speed.py --export demo/export     # the demo's trained model
    python benchmarks/hub_generate_speed.py --prompt-tokens 128 --new-tokens 128 --repeats 5 --threads 1

Both sides decode greedily --new-tokens tokens after the same --prompt-tokens prompt (the document separator, then
tokens of PTB's test text when the export has a tokenizer, else fixed random ids), one forward of one token per new
token with the memory: txl_dist.inference.generate_ids in this process, and ``model.generate(...)`` of transformers
5 in a subprocess of the transformers environment (.venv-hf, or --hf-python), which imports the folder's own
modeling file. The two sides alternate, one call each per round: a warm-up round, then --repeats timed rounds;
the summary quotes medians and the median of the per-round ratios. Tokens/s counts new tokens over the whole call
(prompt included). The transformers side also times the model alone (a plain loop of one-token forwards with the memory,
without generate()'s machinery). Both sides must produce the same tokens; the script checks it. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

HF_TIMER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
print("ready", flush=True)
for line in sys.stdin:  # one JSON job per line: time one generate() call
    job = json.loads(line)
    prompt = torch.tensor([job["prompt"]])
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=job["new_tokens"], do_sample=False, eos_token_id=None,
                         pad_token_id=None)
    seconds = time.perf_counter() - start
    # The model alone: the same decoding as a plain loop of forwards with the memory (no generate() machinery).
    start = time.perf_counter()
    with torch.no_grad():
        step = model(input_ids=prompt, logits_to_keep=1)
        for _ in range(job["new_tokens"] - 1):
            step = model(input_ids=step.logits[:, -1].argmax(-1, keepdim=True), cache=step.cache, logits_to_keep=1)
    loop_seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "loop_seconds": loop_seconds,
                      "tokens": out[0, prompt.shape[1]:].tolist()}), flush=True)
"""


def _prompt(export: Path, n_tokens: int, n_token: int) -> list[int]:
    from txl_dist.export import load_export_tokenizer

    tokenizer = load_export_tokenizer(export)
    if tokenizer is None:
        return torch.randint(0, n_token, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    import treebank

    ids = tokenizer.encode(" ".join(treebank.penn["test"].split()[: 4 * n_tokens]))
    return [tokenizer.eod_id] + ids[: n_tokens - 1]


def _random_export(directory: Path) -> Path:
    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset

    torch.manual_seed(0)
    model = TransformerXLLM(preset("ptb_small")).eval()
    return write_export(model, model.config, directory / "export")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, help="an export folder (default: ptb_small with random weights)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    parser.add_argument(
        "--hf-python", type=Path, default=Path(os.environ.get("TXL_HF_PYTHON", ROOT / ".venv-hf/bin/python"))
    )
    args = parser.parse_args(argv)
    args.hf_python = Path(os.path.abspath(args.hf_python))  # not resolved: the venv's python is a link into it
    if not args.hf_python.is_file():
        parser.error(f"--hf-python {args.hf_python}: missing (make hf-venv creates .venv-hf)")
    return args


def _time_both_sides(args: argparse.Namespace, model, prompt: list[int], hub: Path, scratch: Path) -> dict:
    """Seconds per generate() call on each side, and whether the last calls gave the same tokens."""
    from txl_dist.inference import generate_ids

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))
    worker = subprocess.Popen(
        [str(args.hf_python), "-I", "-c", HF_TIMER, str(hub), str(args.threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=scratch,
    )
    timings = {"txl": [], "hf": [], "loop": []}
    try:
        if worker.stdout.readline().strip() != "ready":
            raise SystemExit("the transformers side did not start (see its error above)")
        job = json.dumps({"prompt": prompt, "new_tokens": args.new_tokens}) + "\n"
        # Alternate the two sides, one call each per round, so that a busy machine slows both alike; the
        # first round warms up.
        for round_index in range(args.repeats + 1):
            start = time.perf_counter()
            txl_tokens = generate_ids(model, prompt, args.new_tokens, greedy=True)
            elapsed = time.perf_counter() - start
            worker.stdin.write(job)
            worker.stdin.flush()
            hf = json.loads(worker.stdout.readline())
            if round_index:
                timings["txl"].append(elapsed)
                timings["hf"].append(hf["seconds"])
                timings["loop"].append(hf["loop_seconds"])
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
    timings["same_tokens"] = hf["tokens"] == txl_tokens
    return timings


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)

    from txl_dist.convert.hub import write_hub_folder
    from txl_dist.export import load_model

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        export = args.export or _random_export(scratch)
        hub = write_hub_folder(export, scratch / "hub")
        model = load_model(export)
        prompt = _prompt(export, args.prompt_tokens, model.config.n_token)
        timings = _time_both_sides(args, model, prompt, hub, scratch)

    txl_rate = args.new_tokens / statistics.median(timings["txl"])
    hf_rate = args.new_tokens / statistics.median(timings["hf"])
    ratios = [t / h for t, h in zip(timings["txl"], timings["hf"])]
    summary = {
        "benchmark": "hub_generate_speed",
        "model": str(args.export) if args.export else "ptb_small (random weights)",
        "n_layer": model.config.n_layer,
        "d_model": model.config.d_model,
        "n_token": model.config.n_token,
        "tgt_len": model.config.tgt_len,
        "mem_len": model.config.mem_len,
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "same_tokens": timings["same_tokens"],
        "txl_dist_tokens_per_s": round(txl_rate, 1),
        "transformers_tokens_per_s": round(hf_rate, 1),
        "transformers_over_txl_dist_median_ratio": round(statistics.median(ratios), 3),
        "modeling_file_forward_loop_tokens_per_s": round(args.new_tokens / statistics.median(timings["loop"]), 1),
    }
    print(
        f"txl_dist.generate: {txl_rate:.1f} tokens/s, transformers generate(): {hf_rate:.1f} tokens/s (medians of "
        f"{args.repeats}), per-round ratio {summary['transformers_over_txl_dist_median_ratio']}; same tokens: "
        f"{summary['same_tokens']}"
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
