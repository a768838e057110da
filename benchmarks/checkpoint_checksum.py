"""What the checkpoint checksums cost at lm1b_base's size: save-time overhead and verification time.

    python benchmarks/checkpoint_checksum.py                      # 8 ranks, files under /tmp, 2 repeats
    python benchmarks/checkpoint_checksum.py --ranks 16 --dir /shared/tmp/bench --repeats 3

Writes a file set shaped like a ZeRO-2 bf16 checkpoint of lm1b_base (357.8M parameters) saved by --ranks ranks:
one model-state file (bf16 weights, 2 bytes a parameter) and one optimizer partition per rank (fp32 masters and
both Adam moments, 12 bytes a parameter over all ranks) -- 14 bytes a parameter, about 5.0 GB. No training: the
tensors are random. Each repeat writes the whole set three ways, in rotating order:

- plain:        ``torch.save(state, path)``, what DeepSpeed's checkpoint engine does;
- atomic:       a temporary file, fsync, rename (txl_dist's save path without the checksum);
- checksummed:  atomic, plus the CRC-32 of the bytes as they pass (txl_dist's save path,
                `txl_dist.fileio.atomic_write_checksummed`).

The checksum's save-time overhead is checksummed - atomic. Then the set is verified as a resume does
(`txl_dist.checkpoints.verify.check_files`: each file's size, then its CRC-32): warm (just written, in the page
cache) and cold (each file evicted from the page cache with posix_fadvise(DONTNEED) first, so it is read from
disk), with one thread over all files and the largest share one rank gets when the ranks share the reading. The
in-memory speed of CRC-32 and of sha256 (the shards' checksum) is printed beside, for the choice. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from txl_dist.checkpoints.verify import check_files, deal_files_to_ranks
from txl_dist.fileio import FileChecksum, atomic_write, atomic_write_checksummed, file_checksum
from txl_dist.model import TransformerXLLM, preset


def lm1b_base_parameters() -> int:
    with torch.device("meta"):
        return TransformerXLLM(preset("lm1b_base")).num_parameters()


def file_set(parameters: int, ranks: int) -> dict[str, dict[str, torch.Tensor]]:
    """name -> state, the sizes of a ZeRO-2 bf16 checkpoint. The ranks' partitions share three tensors (their bytes
    do not matter here, their sizes do), which keeps the benchmark's memory near 1.3 GB."""
    generator = torch.Generator().manual_seed(0)
    per_rank = -(-parameters // ranks)
    partition = {name: torch.randn(per_rank, generator=generator) for name in ("fp32_master", "exp_avg", "exp_avg_sq")}
    files = {"mp_rank_00_model_states.pt": {"module": torch.randn(parameters, generator=generator).bfloat16()}}
    for rank in range(ranks):
        files[f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = dict(partition)
    return files


def write(kind: str, directory: Path, files: dict[str, dict[str, torch.Tensor]]) -> float:
    """Seconds to write the set one of the three ways."""
    started = time.perf_counter()
    for name, state in files.items():
        path = directory / name
        if kind == "plain":
            torch.save(state, path)
        elif kind == "atomic":
            atomic_write(path, lambda handle, s=state: torch.save(s, handle))
        else:
            atomic_write_checksummed(path, lambda handle, s=state: torch.save(s, handle))
    return time.perf_counter() - started


def evict(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def verify(directory: Path, expected: dict[str, FileChecksum]) -> float:
    started = time.perf_counter()
    problems = check_files(directory, expected)
    assert not problems, problems
    return time.perf_counter() - started


def hash_speed(megabytes: int = 256) -> dict[str, float]:
    data = os.urandom(megabytes << 20)
    speeds = {}
    for name, function in (("crc32", lambda: zlib.crc32(data)), ("sha256", lambda: hashlib.sha256(data).digest())):
        best = min(_timed(function) for _ in range(3))
        speeds[name] = len(data) / best / 1e9
    return speeds


def _timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="ranks that saved the checkpoint (default 8)")
    parser.add_argument("--dir", type=Path, help="where to write the files (default: a temporary folder in /tmp)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parameters", type=int, help="default: lm1b_base's")
    args = parser.parse_args(argv)

    parameters = args.parameters or lm1b_base_parameters()
    files = file_set(parameters, args.ranks)
    total_bytes = sum(t.numel() * t.element_size() for state in files.values() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="checkpoint_checksum.", dir=args.dir))
    print(
        f"{parameters:,} parameters, {args.ranks} ranks: {len(files)} files, {total_bytes / 1e9:.2f} GB of tensors "
        f"in {root}",
        file=sys.stderr,
    )
    try:
        times, warm, cold, expected = measure(root, files, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = summary(times, warm, cold, expected, parameters, args)
    print_summary(result, args.repeats, args.ranks)
    print(json.dumps(result))
    return 0


def measure(
    root: Path, files: dict[str, dict[str, torch.Tensor]], repeats: int
) -> tuple[dict[str, list[float]], list[float], list[float], dict[str, FileChecksum]]:
    """Each repeat's save times of the three ways (in rotating order), and its warm and cold verification times;
    with the checksums of the set the last write left."""
    kinds = ["plain", "atomic", "checksummed"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    warm, cold = [], []
    expected: dict[str, FileChecksum] = {}
    for repeat in range(repeats):
        order = kinds[repeat % 3 :] + kinds[: repeat % 3]
        for kind in order:
            seconds = write(kind, root, files)
            times[kind].append(seconds)
            print(f"repeat {repeat}: {kind:<12} {seconds:6.2f} s", file=sys.stderr)
        expected = {name: file_checksum(root / name) for name in files}  # of the set the last write left
        warm.append(verify(root, expected))
        evict(root)
        cold.append(verify(root, expected))
        print(f"repeat {repeat}: verify warm {warm[-1]:.2f} s, cold {cold[-1]:.2f} s", file=sys.stderr)
    return times, warm, cold, expected


def summary(
    times: dict[str, list[float]],
    warm: list[float],
    cold: list[float],
    expected: dict[str, FileChecksum],
    parameters: int,
    args: argparse.Namespace,
) -> dict:
    """The figures of the JSON line: medians over the repeats, the checksum's overhead and the shares."""
    median = {kind: statistics.median(values) for kind, values in times.items()}
    overhead = median["checksummed"] - median["atomic"]
    file_bytes = {name: checksum.bytes for name, checksum in expected.items()}
    largest_share = max(sum(c.bytes for c in share.values()) for share in deal_files_to_ranks(expected, args.ranks))
    share_fraction = largest_share / sum(file_bytes.values())
    speeds = hash_speed()
    return {
        "parameters": parameters,
        "ranks": args.ranks,
        "files": len(expected),
        "bytes": sum(file_bytes.values()),
        "save_plain_s": median["plain"],
        "save_atomic_s": median["atomic"],
        "save_checksummed_s": median["checksummed"],
        "checksum_overhead_s": overhead,
        "checksum_overhead_share_of_save": overhead / median["checksummed"],
        "verify_warm_s": statistics.median(warm),
        "verify_cold_s": statistics.median(cold),
        "verify_cold_largest_rank_share_s": statistics.median(cold) * share_fraction,
        "verify_cold_share_of_save": statistics.median(cold) / median["checksummed"],
        "crc32_gb_per_s": speeds["crc32"],
        "sha256_gb_per_s": speeds["sha256"],
        "repeats": args.repeats,
    }


def print_summary(result: dict, repeats: int, ranks: int) -> None:
    print(
        f"save, whole set by one process (median of {repeats}): plain torch.save {result['save_plain_s']:.2f} s, "
        f"atomic {result['save_atomic_s']:.2f} s, atomic + CRC-32 {result['save_checksummed_s']:.2f} s -> the "
        f"checksum adds {result['checksum_overhead_s']:.2f} s "
        f"({100 * result['checksum_overhead_share_of_save']:.1f}% of the save)"
    )
    print(
        f"verify, one thread over the set: warm {result['verify_warm_s']:.2f} s, "
        f"cold {result['verify_cold_s']:.2f} s "
        f"({100 * result['verify_cold_share_of_save']:.0f}% of a save); shared by {ranks} ranks the largest "
        f"share takes ~{result['verify_cold_largest_rank_share_s']:.2f} s cold"
    )
    print(f"in memory: CRC-32 {result['crc32_gb_per_s']:.2f} GB/s, sha256 {result['sha256_gb_per_s']:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
