"""What the numerics guard costs (docs/recovery.md, Numerical faults), on 2 CPU ranks through the deepspeed launcher.

    python benchmarks/numerics_cost.py                                  # ptb_small, 3 repeats
    python benchmarks/numerics_cost.py --config configs/tiny_cpu.yaml --steps 150 --fault-at 130 --repeats 2

1. Per step: the same run with numerics.check=true and false, alternating within each repeat. The step's loss and
   gradient norm travel in the all-reduce that ends every step either way (it carried the stop request before);
   the check is the verdict on them: the spike detector's median and deviation over its window. tokens/s is the
   median of a run's logging windows after the first; the verdict alone is also timed, per call.
2. A fault: rank 1's loss is NaN at one forward of step F (tests/scripts/numerics_faults, a transient fault), with
   checkpoints every C steps and no snapshots, then with memory snapshots every K steps as well. "Back past the
   fault": the seconds from the fault's detection to the record of the failed step passing on the replay (the
   rollback, the restore and the steps recomputed: its rollback record's seconds plus the wall time from that
   record to the verdict's); each restore's seconds alone. Then the same with a poisoned batch at step F (a fault
   in the data, met by every replay): from the detection to the step numbered F passing after the skipped window,
   which holds the failed replay and the steps after the skip.
The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from training_runs import ptb_word_shards, train  # benchmarks/training_runs.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.numerics_faults import batch_digest, fault_environment  # noqa: E402 -- the tests' fault injection
from txl_dist.config import NumericsConfig  # noqa: E402
from txl_dist.training.numerics import NumericsState, StepHealth, Watch  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="numerics_cost."))
    _, shards = ptb_word_shards(work / "ptb")
    base = [f"train.max_steps={args.steps}", "log.every=10", "eval.every=0", "eval.max_batches=20"]
    figures: dict = {"config": args.config, "steps": args.steps, "per_step": {}, "faults": {}}

    rates: dict[str, list[float]] = {"check on": [], "check off": []}
    for repeat in range(args.repeats):
        for name, check in (("check on", "true"), ("check off", "false")):
            output = work / f"{name.replace(' ', '_')}_{repeat}"
            shutil.rmtree(output, ignore_errors=True)  # a run left by an earlier call would only resume
            records = train(args.config, shards, output, [*base, "checkpoint.every=0", f"numerics.check={check}"])
            rates[name].append(_tokens_per_s(records))
            print(f"repeat {repeat + 1}/{args.repeats} {name:9s} {rates[name][-1]:9.0f} tokens/s", flush=True)
    figures["per_step"]["verdict_us"] = _verdict_microseconds()
    if args.repeats:
        on, off = statistics.median(rates["check on"]), statistics.median(rates["check off"])
        figures["per_step"].update({"tokens_per_s_on": on, "tokens_per_s_off": off, "ratio": on / off})
        print(f"per step: check on {on:.0f} tokens/s, off {off:.0f} tokens/s, ratio {on / off:.3f}", flush=True)
    print(f"the verdict: {figures['per_step']['verdict_us']:.1f} us a step", flush=True)

    world, rank = 2, 1
    poison = batch_digest(shards, base, world_size=world, rank=rank, step=args.fault_at, config=args.config)
    calls_per_step = _forwards_per_step(args.config, world)
    transient = fault_environment(nan_at_call=f"{rank}:{calls_per_step * (args.fault_at - 1) + 1}")
    memory, poisoned = work / "memory", fault_environment(poison=poison)
    snapshots = [f"checkpoint.memory_every={args.memory_every}"]
    cases = {
        "transient, checkpoint": (transient, []),
        "transient, memory snapshot": (transient, snapshots),
        "in the data, checkpoint": (poisoned, []),
        "in the data, memory snapshot": (poisoned, snapshots),
    }
    for name, (env, extra) in cases.items():
        output = work / name.replace(", ", "_").replace(" ", "_")
        shutil.rmtree(output, ignore_errors=True)
        overrides = [*base, f"checkpoint.every={args.checkpoint_every}", f"checkpoint.memory_dir={memory}", *extra]
        records = train(args.config, shards, output, overrides, env=env)
        figures["faults"][name] = case = _fault_figures(records)
        print(
            f"{name:30s} back past the fault in {case['seconds']:6.2f} s, rolled back to step {case['restored']} "
            f"({case['source']}) {case['rollbacks']} time(s), each restore {case['restore_s']:.2f} s, "
            f"{case['recomputed']} step(s) trained again, one step {case['step_s']:.3f} s",
            flush=True,
        )
    print(json.dumps(figures))
    return figures


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "ptb_small.yaml"))
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--fault-at", type=int, default=140, help="the step whose loss is NaN (F)")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="C")
    parser.add_argument("--memory-every", type=int, default=10, help="K")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the per-step comparison (0: none)")
    parser.add_argument("--work-dir", help="where the runs go (default: a new temporary folder)")
    return parser.parse_args(argv)


def _tokens_per_s(records: list[dict]) -> float:
    windows = [r["tokens_per_s"] for r in records if r["kind"] == "train"][1:]
    return statistics.median(windows)


def _forwards_per_step(config: str, world_size: int) -> int:
    from txl_dist.config import load_config

    return load_config(config).train.batch_split(world_size).grad_accum


def _fault_figures(records: list[dict]) -> dict:
    """From a run's records: the seconds from the fault's detection to its step passing, where it rolled back to
    (and from where), the steps trained again (each rollback throws away the steps since the state it restores),
    the rollbacks made and one step's time."""
    events = [r for r in records if r["kind"] == "numerics"]
    rollbacks = [r for r in events if r["event"] == "rollback"]
    passed = next(r for r in events if r["event"] in ("transient", "skip_recorded"))
    first, last = rollbacks[0], rollbacks[-1]
    step_s = statistics.median(r["step_time_s"] for r in records if r["kind"] == "train")
    return {
        "seconds": first["seconds"] + passed["wall_time"] - first["wall_time"],
        "restored": last["restored_step"],
        "source": first["source"],
        "recomputed": sum(r["failed_step"] - r["restored_step"] for r in rollbacks),
        "rollbacks": len(rollbacks),
        "restore_s": statistics.median(r["seconds"] for r in rollbacks),
        "step_s": step_s,
    }


def _verdict_microseconds(steps: int = 20_000) -> float:
    """The verdict on one step, the spike detector's window full (its default 100 steps)."""
    config = NumericsConfig()
    watch = Watch(config, NumericsState(config), fp16=False, n_token=10_000)
    began = time.perf_counter()
    for step in range(steps):
        watch.judge(step, StepHealth(loss=5.0 + (step % 7) * 0.01, grad_norm=0.5), memoryless=False)
    return (time.perf_counter() - began) / steps * 1e6


if __name__ == "__main__":
    main()
