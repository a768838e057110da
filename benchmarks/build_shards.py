"""Throughput and memory of data_tools.build_shards, against bare SentencePiece encoding of the same text.

    python benchmarks/build_shards.py                             # 50 MB and 500 MB, 3 repeats
    python benchmarks/build_shards.py --sizes-mb 20 100 --repeats 1

The text is the Penn Treebank's training set repeated to each size; the tokenizer a unigram SentencePiece model
of 8,000 pieces trained on it. For each size and for 1 and 2 workers, runs of `python -m data_tools.build_shards`
(a new process each, as users run it) alternate with bare encoding (chunks of whole lines -> decode ->
SentencePieceProcessor.encode in the same number of processes, nothing else). Figures are medians over the
repeats:

- MB/s and tokens/s of the build (its own timer: the interpreter's start is not counted, the workers' is);
- peak RSS: the largest sum over all processes of the build (parent, workers, multiprocessing's helper),
  sampled every 20 ms;
- speed-up of 2 workers over 1, and the build's throughput as a share of bare encoding.

Targets: peak RSS within 20% between the sizes; 2 workers >= 1.7x one; build >= 70% of bare encoding.
Ends with one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import treebank

from data_tools import train_tokenizer
from data_tools.corpora import chunking
from data_tools.corpora.inputs import InputFile

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"build_shards: [\d,]+ documents, ([\d,]+) tokens, .* in .*, ([\d.]+) s, [\d.]+ MB/s")

_processor = None


def _start_encoder(model: str) -> None:
    global _processor
    import sentencepiece

    _processor = sentencepiece.SentencePieceProcessor(model_file=model)


def _encode_chunk(data: bytes) -> int:
    lines = data.decode("utf-8").split("\n")
    return sum(map(len, _processor.encode(lines, num_threads=1)))


def bare_encoding(text: Path, model: Path, workers: int) -> tuple[float, int]:
    """Seconds and tokens of SentencePiece alone over the text, in ``workers`` processes (spawned as the build's)."""
    chunks = chunking.read_chunks([InputFile(str(text), text.stat().st_size)], "line", chunking.DEFAULT_CHUNK_BYTES)
    started = time.perf_counter()
    if workers == 1:
        _start_encoder(str(model))
        tokens = sum(_encode_chunk(chunk.data) for chunk in chunks)
    else:
        with multiprocessing.get_context("spawn").Pool(workers, _start_encoder, (str(model),)) as pool:
            tokens = sum(pool.imap(_encode_chunk, (chunk.data for chunk in chunks), chunksize=1))
    return time.perf_counter() - started, tokens


def build(text: Path, tokenizer: Path, output: Path, workers: int) -> tuple[float, int, int]:
    """Seconds (the build's own), tokens and peak RSS bytes (all its processes) of one build."""
    command = [
        sys.executable,
        "-m",
        "data_tools.build_shards",
        "--tokenizer",
        str(tokenizer),
        "--output",
        str(output),
        "--split",
        f"train={text}",
        "--workers",
        str(workers),
        "--overwrite",
        "--no-progress",
    ]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(process.pid)
    peak = 0
    while process.poll() is None:
        try:
            members = [root, *root.children(recursive=True)]
            peak = max(peak, sum(member.memory_info().rss for member in members))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.02)
    stdout, stderr = process.communicate()
    match = SUMMARY.search(stdout)
    if process.returncode or not match:
        raise RuntimeError(f"build failed ({process.returncode}): {stderr[-2000:]}")
    return float(match.group(2)), int(match.group(1).replace(",", "")), peak


def make_text(directory: Path, megabytes: int) -> Path:
    path = directory / f"ptb_train_{megabytes}mb.txt"
    unit = treebank.penn["train"].encode("utf-8")
    with open(path, "wb") as handle:
        written = 0
        while written < megabytes * 1_000_000:
            handle.write(unit)
            written += len(unit)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 500])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as scratch:
        scratch = Path(scratch)
        tokenizer = train_unigram_tokenizer(scratch / "tokenizer")
        results = {}
        for megabytes in args.sizes_mb:
            text = make_text(scratch, megabytes)
            results[f"{megabytes}mb"] = size_figures(text, tokenizer, scratch, megabytes, args.repeats)
            (scratch / text.name).unlink()
        if len(args.sizes_mb) >= 2:
            small, large = (f"{m}mb" for m in (min(args.sizes_mb), max(args.sizes_mb)))
            results["peak_rss_ratio_large_over_small"] = {
                f"workers{w}": round(
                    results[large][f"workers{w}"]["peak_rss_mib"] / results[small][f"workers{w}"]["peak_rss_mib"], 3
                )
                for w in (1, 2)
            }
        for name, figures in results.items():
            print(f"{name}: {figures}")
        print(json.dumps({"benchmark": "build_shards", "repeats": args.repeats, **results}))


def train_unigram_tokenizer(output: Path) -> Path:
    """A unigram SentencePiece model of 8,000 pieces trained on the Penn Treebank."""
    train_tokenizer.main(
        [
            "--kind",
            "sentencepiece",
            "--model-type",
            "unigram",
            "--vocab-size",
            "8000",
            "--character-coverage",
            "1.0",
            "--format",
            "ptb",
            "--output",
            str(output),
            "--no-progress",
        ]
    )
    return output


def size_figures(text: Path, tokenizer: Path, scratch: Path, megabytes: int, repeats: int) -> dict:
    """Builds with 1 and 2 workers alternating with bare encoding over one text, medians over the repeats."""
    size_mb = text.stat().st_size / 1e6
    runs: dict[str, list] = {key: [] for key in ("build1", "build2", "bare1", "bare2")}
    for repeat in range(repeats):
        for workers in (1, 2):
            seconds, tokens, peak = build(text, tokenizer, scratch / "shards", workers)
            runs[f"build{workers}"].append((seconds, tokens, peak))
            bare_seconds, bare_tokens = bare_encoding(text, tokenizer / "spm.model", workers)
            runs[f"bare{workers}"].append((bare_seconds, bare_tokens))
            print(
                f"{megabytes} MB, {workers} worker(s), run {repeat + 1}: build {size_mb / seconds:.1f} MB/s "
                f"(peak RSS {peak / 2**20:.0f} MiB), bare encoding {size_mb / bare_seconds:.1f} MB/s",
                flush=True,
            )
    figures = {}
    for workers in (1, 2):
        seconds = statistics.median(r[0] for r in runs[f"build{workers}"])
        bare_seconds = statistics.median(r[0] for r in runs[f"bare{workers}"])
        tokens = runs[f"build{workers}"][0][1]
        figures[f"workers{workers}"] = {
            "mb_per_s": round(size_mb / seconds, 2),
            "tokens_per_s": round(tokens / seconds),
            "peak_rss_mib": round(statistics.median(r[2] for r in runs[f"build{workers}"]) / 2**20, 1),
            "bare_mb_per_s": round(size_mb / bare_seconds, 2),
            "share_of_bare": round(bare_seconds / seconds, 3),
        }
    figures["speedup_2_over_1"] = round(figures["workers2"]["mb_per_s"] / figures["workers1"]["mb_per_s"], 3)
    figures["bare_speedup_2_over_1"] = round(
        figures["workers2"]["bare_mb_per_s"] / figures["workers1"]["bare_mb_per_s"], 3
    )
    figures["text_mb"] = round(size_mb, 1)
    return figures


if __name__ == "__main__":
    main()
