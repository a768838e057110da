"""A small-scale smoke of benchmarks/lm1b_scale.py: every stage runs and reports its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launcher

REPO = Path(__file__).resolve().parents[1]


def test_every_stage_runs_at_a_small_scale(tmp_path):
    command = [
        sys.executable,
        "benchmarks/lm1b_scale.py",
        "--scale",
        "0.0005",
        "--work-dir",
        str(tmp_path),
        "--stream-seconds",
        "0.5",
        "--train-config",
        "configs/tiny_cpu.yaml",
        "--train-steps",
        "1",
        "--train-overrides",
        "train.micro_batch=1",
        "--clean",
    ]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    figures = json.loads(completed.stdout.strip().splitlines()[-1])
    assert figures["corpus"]["train_sentences"] == 99 * 153
    vocabulary, shards = figures["vocabulary"], figures["shards"]
    assert vocabulary["vocab_size"] > 1000 and vocabulary["workers"] == 2 and vocabulary["mb_per_s"] > 0
    assert shards["identical_shards"] is True and shards["workers1"]["tokens"] == shards["workers2"]["tokens"]
    assert shards["workers2"]["peak_rss_mib"] > 0 and shards["speedup_2_over_1"] > 0
    assert figures["streams"]["tokens_per_s"] > 0
    training = figures["training"]
    assert training["steps"] == 1 and training["peak_rss_mib_rank0"] > 0 and training["planned_peak_mib"] > 0
    assert set(figures["targets_met"]) >= {"vocabulary_seconds<=90", "shards_seconds<=90", "speedup_2_over_1>=1.7"}
    assert not any(tmp_path.glob("shards_*")) and not (tmp_path / "corpus").exists()  # --clean
