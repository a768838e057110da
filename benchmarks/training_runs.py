"""What the benchmarks share: Penn Treebank shards, real runs of launchers/train.py and their outputs.

Runs go through the shipped `deepspeed` launcher on CPU ranks (DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1), exactly
as users start them; the figures come from the run's own metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from data_tools import build_shards, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


def ptb_word_shards(directory: Path) -> tuple[Path, Path]:
    """(tokenizer, shards) of the Penn Treebank with its 10,000-word vocabulary, built once into ``directory``."""
    tokenizer, shards = directory / "tokenizer", directory / "shards"
    if not (shards / "manifest.json").is_file():
        train_tokenizer.main(
            ["--kind", "word", "--format", "ptb", "--output", str(tokenizer), "--overwrite", "--no-progress"]
        )
        build_shards.main(
            ["--tokenizer", str(tokenizer), "--output", str(shards), "--format", "ptb", "--overwrite", "--no-progress"]
        )
    return tokenizer, shards


def train(
    config: str,
    shards: Path,
    output_dir: Path,
    overrides: list[str],
    ranks: int = 2,
    port: int = 29561,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Run launchers/train.py to the end (``env``: variables added to its environment); return its metrics.jsonl
    records."""
    script = ["launchers/train.py", "--config", config, f"data.shards={shards}", f"train.output_dir={output_dir}"]
    launch([*script, *overrides], port, ranks, env)
    return metrics(output_dir)


def launch(script: list[str], port: int, ranks: int = 2, extra_env: dict[str, str] | None = None) -> None:
    """Run ``script`` (a path and its arguments) on ``ranks`` CPU ranks through the deepspeed launcher."""
    extra_env = dict(extra_env or {})
    paths = [str(REPO), extra_env.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        **extra_env,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(path for path in paths if path),
    }
    command = [DEEPSPEED, "--num_gpus", str(ranks), "--master_port", str(port), *script]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    remove_allreduce_buffers(port)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def remove_allreduce_buffers(port: int) -> None:
    """Unlink the shared-memory files that DeepSpeed's CPU all-reduce leaves behind
    (``deepspeed_allreduce_buffer_{...}_{master address}_{master port}_{rank}``), this port's only."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)


def metrics(output_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    lines = (output_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def run_config(config: str, overrides: list[str], shards: Path):
    """The config a run of launchers/train.py trains with: the file, the overrides, the manifest's vocabulary."""
    from txl_dist.config import load_config
    from txl_dist.data.run_vocab import with_shards_vocab

    return with_shards_vocab(load_config(config, [*overrides, f"data.shards={shards}"]))


def last_json_line(stdout: str) -> dict:
    """The JSON object on the last line of a benchmark process's output."""
    return json.loads(stdout.strip().splitlines()[-1])


def evaluate(model_dir: Path, split: str, name: str, *extra: str) -> dict:
    """launchers/evaluate.py on one process; its JSON result (kept as ``{model_dir}/eval_{name}.json``)."""
    out = model_dir / f"eval_{name}.json"
    command = [
        sys.executable,
        "launchers/evaluate.py",
        str(model_dir),
        "--split",
        split,
        "--no-progress",
        "--output",
        str(out),
        *extra,
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text(encoding="utf-8"))
