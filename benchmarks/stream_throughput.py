"""Throughput and memory of `TrainStreams` reading local shards: tokens/s per rank and peak RSS.

The corpus is the Penn Treebank training text repeated until it holds at least ``--tokens`` tokens, its words
mapped to ids with a plain dict (the loader is measured, not a tokenizer), written as shards by
`data_tools.shards.writer.ShardWriter`. Each measurement runs in a fresh process, one rank (rank 0 of
``--world-size``) iterating its micro-batches of ``--micro-batch`` x ``--tgt-len`` for up to ``--seconds``; tokens
are counted as micro_batch x tgt_len per micro-batch (the targets a trainer scores). Shards are read through the
page cache, as they are right after being written; ``pipe_sequential`` reads the same shards through
``pipe:cat`` URLs (webdataset's streaming path, one pipe per stream), as for shards on object storage.

    python benchmarks/stream_throughput.py                      # 100M and 300M tokens, all three ways
    python benchmarks/stream_throughput.py --tokens 100e6 --repeats 5

The last line of output is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from data_tools.shards.writer import ShardWriter
from txl_dist.data.format import Manifest, SplitEntry, TokenizerIdentity, read_manifest, token_dtype, write_manifest


def build_ptb_shards(directory: Path, min_tokens: int, block_tokens: int, tokens_per_shard: int) -> int:
    """PTB train, words to ids with a dict, each sentence followed by the separator, repeated to >= min_tokens."""
    import treebank

    sentences = [line.split() for line in treebank.penn["train"].split("\n") if line.strip()]
    vocabulary: dict[str, int] = {"<eos>": 0}
    ids = []
    for words in sentences:
        ids.extend(vocabulary.setdefault(word, len(vocabulary)) for word in words)
        ids.append(0)
    dtype = token_dtype(len(vocabulary))
    corpus = np.array(ids, dtype=dtype)
    repeats = -(-min_tokens // corpus.size)
    with ShardWriter(directory, "train", len(vocabulary), dtype, tokens_per_shard) as writer:
        for _ in range(repeats):
            for start in range(0, corpus.size, block_tokens):
                writer.add_block(corpus[start : start + block_tokens], np.array([0]))
    shards = writer.shards
    split = SplitEntry(
        documents=sum(s.documents for s in shards),
        tokens=sum(s.tokens for s in shards),
        blocks=sum(s.blocks for s in shards),
        shards=shards,
    )
    tokenizer = TokenizerIdentity(kind="word", vocab_size=len(vocabulary), fingerprint="0" * 64, eos_id=0, eod_id=0)
    write_manifest(
        directory, Manifest(tokenizer=tokenizer, dtype=dtype.name, block_tokens=block_tokens, splits={"train": split})
    )
    return split.tokens


def rss_mib() -> float:
    """Resident memory of this process now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def measure(directory: str, micro_batch: int, tgt_len: int, world_size: int, shuffle: bool, seconds: float) -> dict:
    """One rank's reading speed and memory, in this (fresh) process: one epoch, or ``seconds`` of it."""
    from txl_dist.data import TrainStreams

    before = rss_mib()
    streams = TrainStreams(
        directory,
        "train",
        tgt_len=tgt_len,
        micro_batch=micro_batch,
        grad_accum=1,
        world_size=world_size,
        rank=0,
        shuffle_blocks=shuffle,
    )
    batches = 0
    start = time.perf_counter()
    for batch in streams:
        if batch.epoch > 0 or (batches % 1024 == 0 and time.perf_counter() - start >= seconds):
            break
        batches += 1
    elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": batches * micro_batch * tgt_len / elapsed,
        "tokens_read": batches * micro_batch * tgt_len,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loader_rss_mib": rss_mib() - before,
    }


def main() -> None:
    args = _parse_args()
    if args.measure:
        print(
            json.dumps(
                measure(args.measure, args.micro_batch, args.tgt_len, args.world_size, args.shuffle, args.seconds)
            )
        )
        return

    figures = {
        "micro_batch": args.micro_batch,
        "tgt_len": args.tgt_len,
        "world_size": args.world_size,
        "block_tokens": args.block_tokens,
        "corpora": [],
    }
    with tempfile.TemporaryDirectory(prefix="stream_throughput.") as scratch:
        for min_tokens in args.tokens:
            directory = Path(scratch) / f"ptb_{int(min_tokens)}"
            directory.mkdir()
            started = time.perf_counter()
            num_tokens = build_ptb_shards(directory, int(min_tokens), args.block_tokens, args.tokens_per_shard)
            print(f"built {num_tokens:,} tokens of PTB in {time.perf_counter() - started:.1f} s", flush=True)
            piped = piped_copy(directory, Path(scratch) / f"ptb_{int(min_tokens)}_pipe")
            corpus = {"tokens": num_tokens}
            for order, source, shuffle in (
                ("sequential", directory, False),
                ("shuffled", directory, True),
                ("pipe_sequential", piped, False),
            ):
                corpus[order] = summary = _measured_order(source, shuffle, args)
                print(
                    f"  {order:15s} {summary['tokens_per_s'] / 1e6:6.1f} M tokens/s per rank "
                    f"(runs: {', '.join(f'{r / 1e6:.1f}' for r in summary['tokens_per_s_runs'])}); "
                    f"{summary['tokens_read'] / 1e6:.0f} M tokens read; peak RSS {summary['peak_rss_mib']:.0f} MiB, "
                    f"{summary['loader_rss_mib']:.1f} MiB more after reading than before the loader",
                    flush=True,
                )
            figures["corpora"].append(corpus)
    print(json.dumps(figures))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, nargs="+", default=[100e6, 300e6], help="corpus sizes to build")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--tgt-len", type=int, default=32)
    parser.add_argument("--world-size", type=int, default=1, help="the measured rank is rank 0 of this many")
    parser.add_argument("--block-tokens", type=int, default=65536)
    parser.add_argument("--tokens-per-shard", type=int, default=64 * 2**20)
    parser.add_argument("--seconds", type=float, default=60.0, help="reading time cap per measurement (one epoch)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: run one measurement in this process
    parser.add_argument("--shuffle", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def piped_copy(directory: Path, piped: Path) -> Path:
    """A manifest in ``piped`` whose shards are the same files read through ``pipe:cat`` URLs."""
    piped.mkdir()
    manifest = read_manifest(directory)
    for shard in manifest.splits["train"].shards:
        shard.path = f"pipe:cat {directory / shard.path}"
    write_manifest(piped, manifest)
    return piped


def _measured_order(source: Path, shuffle: bool, args: argparse.Namespace) -> dict:
    """Medians over ``args.repeats`` measurements, each in a fresh process, and each run's tokens/s."""
    runs = []
    for _ in range(args.repeats):
        command = [
            sys.executable,
            __file__,
            "--measure",
            str(source),
            "--micro-batch",
            str(args.micro_batch),
            "--tgt-len",
            str(args.tgt_len),
            "--world-size",
            str(args.world_size),
            "--seconds",
            str(args.seconds),
        ] + (["--shuffle"] if shuffle else [])
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(output.strip().splitlines()[-1]))
    summary = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    summary["tokens_per_s_runs"] = [round(run["tokens_per_s"]) for run in runs]
    return summary


if __name__ == "__main__":
    main()
