"""How long training waits for a checkpoint: a synchronous save against a background save
(checkpoint.background, `txl_dist.checkpoints.background`), for one rank's state of a model the size of a config.

    python benchmarks/checkpoint_stall.py                                  # lm1b_base, 3 repeats, in a temp folder
    python benchmarks/checkpoint_stall.py --config configs/ptb_small.yaml --repeats 5 --dir /shared/scratch

The state is what one rank of a 1-rank ZeRO-1/2 run in fp32 writes: the model's weights (the model is built on
the meta device for its shapes, then filled) in one file, and the optimizer's fp32 partition with Adam's two
moments in another (16 bytes per parameter in all). The synchronous save writes both files as the trainer does
(`txl_dist.fileio.atomic_write_checksummed`: temporary name, fsync, rename, CRC-32), and training waits for all
of it. The background save copies both into host memory (`host_copy`) and hands them to a `BackgroundWrite`
thread: training waits for the copy only (the stall); the thread's write time is printed beside it. The host
buffers are kept from one save to the next, as the trainer keeps them: the first background save allocates them
(its stall is printed apart), the others only copy. The two
alternate within a repeat so that the machine's noise hits both. The last line is one JSON object of the medians
and the ratio stall / synchronous save (the goal: at most 0.10).

``--deepspeed-decoupled`` adds DeepSpeed's DecoupledCheckpointEngine (its helper process running the
FastCheckpointEngine with the PYTHON writer: the FAST writer needs DeepNVMe's asynchronous I/O op, which needs
libaio and is built for GPU nodes) on a single-process gloo group: the stall is the time its save() takes to hand
each file's state (a fresh copy, as a safe use needs: it passes the tensors themselves to its helper through
shared memory) to the helper, the write the time until its commit returns. It holds a third copy of the state in
memory: use a smaller config than lm1b_base on a 24 GB machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import types
from pathlib import Path

import torch

from txl_dist.checkpoints.background import BackgroundWrite, HostBuffers, host_copy, torch_save_job
from txl_dist.config import load_config
from txl_dist.fileio import atomic_write_checksummed
from txl_dist.model import TransformerXLLM


def rank_state(config: str) -> tuple[dict, dict, int]:
    """(the model's weights, the optimizer's state, the number of parameters) of CONFIG's model, filled."""
    cfg = load_config([config], [])
    with torch.device("meta"):
        model = TransformerXLLM(cfg.model)
    weights = {name: torch.randn(tensor.shape) for name, tensor in model.state_dict().items()}
    count = sum(parameter.numel() for parameter in model.parameters())
    optimizer = {
        "fp32_flat_groups": [torch.randn(count)],
        "optimizer_state_dict": {"state": {0: {"exp_avg": torch.randn(count), "exp_avg_sq": torch.rand(count)}}},
    }
    return {"module": weights}, optimizer, count


def synchronous(folder: Path, files: dict[str, dict]) -> float:
    began = time.perf_counter()
    for name, state in files.items():
        atomic_write_checksummed(folder / name, lambda handle, state=state: torch.save(state, handle))
    return time.perf_counter() - began


def background(folder: Path, files: dict[str, dict], buffers: HostBuffers) -> tuple[float, float]:
    """(the stall, the thread's write time). BUFFERS: the host copies, kept from one save to the next as the
    trainer keeps them (the first save allocates them)."""
    began = time.perf_counter()
    jobs = [torch_save_job(str(folder / name), host_copy(state, buffers, (name,))) for name, state in files.items()]
    write = BackgroundWrite(jobs)
    write.start()
    stall = time.perf_counter() - began
    write.wait()
    if write.error is not None:
        raise write.error
    return stall, write.seconds


def deepspeed_decoupled(folder: Path, files: dict[str, dict], engine) -> tuple[float, float]:
    """(the stall, the write) of DeepSpeed's DecoupledCheckpointEngine ENGINE for FILES."""
    # deepspeed only with --deepspeed-decoupled: the default comparison needs none of it
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    copies = {name: host_copy(state) for name, state in files.items()}  # not timed: the stall is the handing over
    info = CheckpointCommitInfo(tag=folder.name, save_dir=str(folder.parent), save_latest=False)
    engine.create(info)
    began = time.perf_counter()
    for name, state in copies.items():
        engine.save(state, str(folder / name))
    stall = time.perf_counter() - began
    engine.commit(info)
    return stall, time.perf_counter() - began


def decoupled_engine():
    """DeepSpeed's DecoupledCheckpointEngine for one process (a gloo group of one), PYTHON writer."""
    import deepspeed  # only with --deepspeed-decoupled
    from deepspeed.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
    from deepspeed.runtime.model_checkpointing.data_parallel_writer_factory import DataParallelWriterConfig

    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29677"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="gloo")
    writer = {"type": "PYTHON", "io_buffer_size": 64 << 20, "io_buffer_double": True, "io_multiplier": 1}
    config = types.SimpleNamespace(
        checkpoint_config={"checkpoint_serialization": True, "writer": {**writer, "show_statistics": False}},
        aio_config={},
    )
    return DecoupledCheckpointEngine(config, DataParallelWriterConfig(1, 0, 0, 0, True), False)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/lm1b_base.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temp folder)")
    parser.add_argument("--deepspeed-decoupled", action="store_true", help="also DeepSpeed's decoupled engine")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="checkpoint_stall.", dir=args.dir))
    weights, optimizer, count = rank_state(args.config)
    files = {"mp_rank_00_model_states.pt": weights, "zero_pp_rank_0_mp_rank_00_optim_states.pt": optimizer}
    gigabytes = 16 * count / 1e9
    print(f"{args.config}: {count / 1e6:.0f}M parameters, {gigabytes:.2f} GB per save, written to {work}")
    runs: dict[str, list[float]] = {"sync_s": [], "stall_s": [], "background_write_s": []}
    kinds = ["sync", "background"]
    engine = None
    if args.deepspeed_decoupled:
        engine = decoupled_engine()
        runs.update(decoupled_stall_s=[], decoupled_write_s=[])
        kinds.append("decoupled")
    buffers = HostBuffers()
    try:
        for repeat in range(args.repeats):
            for kind in kinds:
                folder = work / f"{kind}{repeat}"
                folder.mkdir()
                if kind == "sync":
                    runs["sync_s"].append(synchronous(folder, files))
                    print(f"repeat {repeat}: synchronous save {runs['sync_s'][-1]:.2f} s")
                elif kind == "decoupled":
                    stall, written = deepspeed_decoupled(folder, files, engine)
                    runs["decoupled_stall_s"].append(stall)
                    runs["decoupled_write_s"].append(written)
                    print(f"repeat {repeat}: DeepSpeed's decoupled engine: waited {stall:.2f} s, wrote {written:.2f} s")
                else:
                    stall, written = background(folder, files, buffers)
                    runs["stall_s"].append(stall)
                    runs["background_write_s"].append(written)
                    print(
                        f"repeat {repeat}: background save: training waited {stall:.2f} s, thread wrote {written:.2f} s"
                    )
                shutil.rmtree(folder)
    finally:
        if engine is not None:
            engine.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    first_stall = runs["stall_s"][0]
    if len(runs["stall_s"]) > 1:  # the first background save allocates the host buffers; the others reuse them
        runs["stall_s"] = runs["stall_s"][1:]
    medians = {name: statistics.median(values) for name, values in runs.items()}
    summary = {
        "config": args.config,
        "parameters": count,
        "gigabytes": round(gigabytes, 2),
        "repeats": args.repeats,
        **{name: round(value, 3) for name, value in medians.items()},
        "stall_over_sync": round(medians["stall_s"] / medians["sync_s"], 3),
        "first_stall_s": round(first_stall, 3),
    }
    print(
        f"median: synchronous {medians['sync_s']:.2f} s; background: training waited {medians['stall_s']:.2f} s "
        f"({summary['stall_over_sync']:.1%} of the synchronous save); the thread wrote "
        f"{medians['background_write_s']:.2f} s"
    )
    if engine is not None:
        print(
            f"median: DeepSpeed's decoupled engine: training waited {medians['decoupled_stall_s']:.2f} s, its helper "
            f"wrote {medians['decoupled_write_s']:.2f} s"
        )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
