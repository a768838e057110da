"""What each fault costs a run on the test cluster (tests/cluster/harness.py: Slurm 22.05, three CPU nodes as
network namespaces, each with its own /dev/shm), with Slurm's SlurmdTimeout at its default of 300 s.

    python benchmarks/fault_costs.py                          # every scenario once (root; ~10 minutes)
    python benchmarks/fault_costs.py --repeats 3 --scenarios rank,rank+snapshots

Scenarios (each a `sbatch launchers/slurm.sbatch` job of configs/tiny_cpu.yaml on two training nodes, one rank
each, checkpoints every 50 steps; the fault at step 60):

- ``rank``: rank 1 killed (SIGKILL, as the OOM killer sends) on a healthy node;
- ``node``: the second node killed with everything on it (its processes and its memory) and cut off;
- ``node+spare``: the same with a third node kept as a spare (TXL_SPARE_NODES=1);
- ``...+snapshots``: the same with checkpoint.memory_every=5.

For each: the seconds from the fault until the relaunched run has logged a step past the one it was at (the
detection, the relaunch, the restore and the recomputation), the steps recomputed (the step it was at minus the
step it resumed from), and the world it finished in. The last line is one JSON object of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

from training_runs import ptb_word_shards  # benchmarks/training_runs.py, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.harness import Cluster  # noqa: E402 -- the test cluster, as the tests build it
from tests.cluster.runs import fresh, job_output, running_at_step, sbatch_job, wait_for_logged_step  # noqa: E402
from tests.launcher import records  # noqa: E402

SCENARIOS = ("rank", "rank+snapshots", "node", "node+snapshots", "node+spare", "node+spare+snapshots")
STEPS = 100
FAULT_AT = 60


def run_scenario(cluster: Cluster, shared: Path, scenario: str) -> dict:
    directory = fresh(shared, scenario.replace("+", "-"))
    spare = "spare" in scenario
    extra = ["train.stall_timeout=20"] + (["checkpoint.memory_every=5"] if "snapshots" in scenario else [])
    options = ["--time=10"] + ([f"--partition={cluster.spare_partition}"] if spare else [])
    job = sbatch_job(
        cluster,
        directory,
        STEPS,
        *options,
        extra=tuple(extra),
        env={"TXL_SPARE_NODES": "1"} if spare else None,
        memory=(),
        nodes=3 if spare else 2,
    )
    lost = cluster.all_nodes[1]
    running_at_step(cluster, job, directory, FAULT_AT)
    lost_at = max(records(directory / "run"))
    began = time.monotonic()
    if scenario.startswith("rank"):
        os.kill(cluster.rank_pid(job, lost), signal.SIGKILL)
    else:
        cluster.kill_node(lost)
        cluster.disconnect_node(lost)
    try:
        back = None
        while back is None and time.monotonic() - began < 300:
            out = job_output(directory)
            logged = records(directory / "run")
            if "resumed from" in out and logged and max(logged) > lost_at:
                back = time.monotonic() - began
            time.sleep(0.25)
        wait_for_logged_step(directory / "run", STEPS, timeout=300)
    finally:
        if not scenario.startswith("rank"):
            cluster.reconnect_node(lost)
            cluster.restart_node(lost)
            cluster.resume_node(lost)
    cluster.wait_job(job, timeout=120)
    out = job_output(directory)
    resumed = re.findall(r"resumed from \S+ at step (\d+)", out)
    worlds = re.findall(r"on (\d+) rank\(s\): global batch", out)
    return {
        "scenario": scenario,
        "lost_at": lost_at,
        "back_s": round(back, 1) if back is not None else None,
        "recomputed": lost_at - int(resumed[-1]) if resumed else None,
        "world": int(worlds[-1]) if worlds else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    scenarios = args.scenarios.split(",")
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cluster = Cluster.start()
    results: dict[str, list[dict]] = {scenario: [] for scenario in scenarios}
    try:
        shared = cluster.shared_dir / "fault_costs"
        ptb_word_shards(shared)  # shared/shards, where the cluster runs read them
        with cluster.slurmd_timeout(300):
            for repeat in range(args.repeats):
                for scenario in scenarios:
                    result = run_scenario(cluster, shared, scenario)
                    results[scenario].append(result)
                    print(json.dumps({"repeat": repeat, **result}), flush=True)
    finally:
        cluster.stop()
    summary = {}
    print(f"{'scenario':<24} {'back past the lost step':>24} {'steps recomputed':>17} {'world':>6}")
    for scenario, runs in results.items():
        back = statistics.median(run["back_s"] for run in runs if run["back_s"] is not None)
        recomputed = statistics.median(run["recomputed"] for run in runs if run["recomputed"] is not None)
        summary[scenario] = {"back_s": back, "recomputed": recomputed, "world": runs[-1]["world"]}
        print(f"{scenario:<24} {back:>22.0f} s {recomputed:>17.0f} {runs[-1]['world']:>6}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
