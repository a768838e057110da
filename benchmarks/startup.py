"""How long each command takes to print its --help, and whether that imported torch or DeepSpeed.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python benchmarks/startup.py
    python benchmarks/startup.py --repeats 9 --python .venv/bin/python --only train plan

Each command runs ``<python> <command> --help`` --repeats times in a fresh process (through a small wrapper that
runs the script or module as ``python`` would, then reports which of torch and deepspeed are in ``sys.modules``)
and the table gives the median wall time of those processes. The functions a command imports lazily (a comment
``# lazy:`` on the import) are what keep torch out of --help. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name in the table, how python is told to run it: a script path or ``-m module``)
COMMANDS = (
    ("train", "launchers/train.py"),
    ("evaluate", "launchers/evaluate.py"),
    ("convert", "launchers/convert.py"),
    ("generate", "launchers/generate.py"),
    ("build_shards", "data_tools/build_shards.py"),
    ("train_tokenizer", "data_tools/train_tokenizer.py"),
    ("inspect_shards", "data_tools/inspect_shards.py"),
    ("synthetic_lm1b", "-m benchmarks.corpora.synthetic_lm1b"),
    ("synthetic_charlm", "-m benchmarks.corpora.synthetic_charlm"),
    ("plan", "-m txl_dist.plan"),
    ("plot", "-m txl_dist.plot"),
    ("launch_env", "-m txl_dist.rendezvous.launch_env"),
    ("slurm_nodes", "-m txl_dist.supervision.slurm_nodes"),
)

HEAVY = ("torch", "deepspeed")

# Runs the command as `python TARGET --help` would (runpy, with sys.argv set), then prints which heavy modules
# got imported. --help ends in SystemExit(0), caught so that the report still prints.
_WRAPPER = """
import json, runpy, sys
target, heavy = sys.argv[1], sys.argv[2].split(",")
sys.argv = [target, "--help"]
status = 0
try:
    if target.startswith("-m "):
        sys.argv[0] = target[3:]
        runpy.run_module(target[3:], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, target.rsplit("/", 1)[0])
        runpy.run_path(target, run_name="__main__")
except SystemExit as stop:
    status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
print("\\nSTARTUP " + json.dumps({"status": status, "imported": [m for m in heavy if m in sys.modules]}))
"""


def help_run(python: str, target: str, env: dict[str, str]) -> tuple[float, dict]:
    """(wall seconds, the wrapper's report) of one ``--help`` of ``target`` in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run(
        [python, "-c", _WRAPPER, target, ",".join(HEAVY)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,  # a --help that waits on something (a lock, a rendezvous) is a failure, not a figure
    )
    seconds = time.perf_counter() - start
    reports = [line for line in done.stdout.splitlines() if line.startswith("STARTUP ")]
    if done.returncode != 0 or not reports:
        raise RuntimeError(f"{target} --help: exit {done.returncode}\n{done.stderr[-2000:]}")
    return seconds, json.loads(reports[-1][len("STARTUP ") :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter to time (default: this one)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per command (default: 5)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these commands (names of the table)")
    args = parser.parse_args(argv)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    results = {}
    print(f"{'command':<16} {'median s':>9} {'min s':>7}  heavy imports")
    for name, target in COMMANDS:
        if args.only and name not in args.only:
            continue
        times, report = [], {}
        for _ in range(args.repeats):
            seconds, report = help_run(args.python, target, env)
            times.append(seconds)
        results[name] = {
            "median_s": round(statistics.median(times), 3),
            "min_s": round(min(times), 3),
            "status": report["status"],
            "imported": report["imported"],
        }
        heavy = ", ".join(report["imported"]) or "none"
        print(f"{name:<16} {statistics.median(times):9.2f} {min(times):7.2f}  {heavy}", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
