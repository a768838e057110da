"""Fake `scontrol`, `srun` and `scancel` on PATH, for the quick tests of txl_dist.supervision.slurm_nodes and
launchers/slurm.sbatch (the real Slurm: tests/cluster/).

Each answers from the files of one folder, as Slurm would for one job: ``job`` (the ``scontrol show job -o``
record), ``nodes`` (one ``scontrol show node -o`` record a line), ``srun_status`` (the exit status of each srun in
turn, one a line; 0 once they are used up), ``requeue_refused`` (when it exists, `scontrol requeue` fails with its
text, as Slurm refuses a job submitted with --no-requeue) and ``calls`` (every command line they were given, one a
line, appended) and ``dead_nodes`` (nodes on which a one-task ``srun ... hostname``, the planner's question
whether a node still runs a step, fails as srun does for a dead node; it prints the node's name elsewhere).
``hooks/NAME`` is run by the fake NAME (srun, scontrol-requeue) before it answers, with the folder as its working
directory and the caller's environment (TXL_LAUNCH, for a training step): where a test sends the batch script a
signal, or writes what the ranks of a failing step would record, at that moment.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

_FAKE = r"""#!{python}
import os, re, subprocess, sys, time
from pathlib import Path

folder = Path({folder!r})
name, args = {name!r}, sys.argv[1:]
with open(folder / "calls", "a") as calls:
    calls.write(" ".join([name, *args]) + "\n")


def hook(which):
    if (folder / "hooks" / which).exists():
        subprocess.run(["bash", str(folder / "hooks" / which)], cwd=folder, check=True)


def expand(hostlist):
    names = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\]", part)
        if not match:
            names.append(part)
            continue
        for piece in match.group(2).split(","):
            low, _, high = piece.partition("-")
            for number in range(int(low), int(high or low) + 1):
                names.append(f"{{match.group(1)}}{{number:0{{len(low)}}d}}")
    return names


if name == "srun" and args[-1:] == ["hostname"]:
    node = [arg.split("=", 1)[1] for arg in args if arg.startswith("--nodelist=")][0]
    dead = (folder / "dead_nodes").read_text().split() if (folder / "dead_nodes").exists() else []
    if node in dead:
        print(f"srun: error: Task launch for StepId=7.9 failed on node {{node}}: Communication connection failure",
              file=sys.stderr)
        sys.exit(1)
    print(node)
    sys.exit(0)
if name == "srun":
    hook("srun")
    statuses = (folder / "srun_status").read_text().split() if (folder / "srun_status").exists() else []
    (folder / "srun_status").write_text("\n".join(statuses[1:]))
    sys.exit(int(statuses[0]) if statuses else 0)
if name == "scancel":
    sys.exit(0)
if args[:2] == ["show", "hostnames"]:
    print("\n".join(expand(args[2])))
elif args[:2] == ["show", "job"]:
    print((folder / "job").read_text(), end="")
elif args[:2] == ["show", "node"]:
    wanted = set(expand(args[-1]))
    for line in (folder / "nodes").read_text().splitlines():
        if line.split()[0].removeprefix("NodeName=") in wanted:
            print(line)
elif args[:1] == ["requeue"]:
    hook("scontrol-requeue")
    if (folder / "requeue_refused").exists():
        print((folder / "requeue_refused").read_text().strip(), file=sys.stderr)
        sys.exit(1)
else:
    print(f"fake scontrol: {{args}} not known", file=sys.stderr)
    sys.exit(1)
"""


def install(folder: Path) -> dict[str, str]:
    """Writes the fakes into FOLDER/bin and returns an environment with them first on PATH."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (folder / "calls").touch()
    for name in ("scontrol", "srun", "scancel"):
        path = bin_dir / name
        path.write_text(_FAKE.format(python=sys.executable, folder=str(folder), name=name))
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def calls(folder: Path, name: str) -> list[str]:
    """The command lines the fake NAME (``srun``, ``scontrol requeue``, ...) was given, in order."""
    return [line for line in (folder / "calls").read_text().splitlines() if re.match(rf"{re.escape(name)}\b", line)]
