"""The test tiers of docs/architecture.md (Tests): the markers each slow test file or test carries, and the guard in
tests/conftest.py that fails a test starting a launcher, a cluster command or .venv-hf without its marker."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
QUICK = "not launcher and not cluster and not hf"


def _file_markers(path: Path) -> set[str]:
    """The markers a test file's module-level ``pytestmark`` names (pytest.mark.X, alone or in a list)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return {v.attr for v in values if isinstance(v, ast.Attribute)}
    return set()


@pytest.mark.parametrize("path", sorted((ROOT / "tests" / "cluster").glob("test_*.py")), ids=lambda p: p.name)
def test_every_file_of_the_cluster_folder_says_its_tier(path):
    """The folder is the cluster tier: each of its test files says so in its own pytestmark."""
    assert "cluster" in _file_markers(path), f"{path.relative_to(ROOT)}: no pytestmark = pytest.mark.cluster"


def test_a_files_marker_reaches_its_tests():
    assert _file_markers(ROOT / "tests" / "test_liveness.py") == {"launcher"}
    assert "hf" in _file_markers(ROOT / "tests" / "test_tf_release.py")
    assert _file_markers(ROOT / "tests" / "test_model.py") == set()


@pytest.mark.parametrize(
    ("argv", "marker"),
    [
        (["/x/.venv/bin/deepspeed", "--num_gpus", "2", "launchers/train.py"], "launcher"),
        (["torchrun", "--nproc-per-node", "2", "t.py"], "launcher"),
        ([sys.executable, "-m", "torch.distributed.run", "t.py"], "launcher"),
        (["mpirun", "-n", "2", "python"], "launcher"),
        (["srun", "--overlap", "true"], "cluster"),
        (["ip", "netns", "add", "n1"], "cluster"),
        ([sys.executable, "-c", "print(1)"], None),
        (["git", "status"], None),
    ],
)
def test_slow_starts_are_recognised(argv, marker):
    assert conftest._slow_start(argv) == marker


def test_the_hf_interpreter_is_a_slow_start(monkeypatch, tmp_path):
    monkeypatch.setenv("TXL_HF_PYTHON", str(tmp_path / "python"))
    assert conftest._slow_start([str(tmp_path / "python"), "-I", "worker.py"]) == "hf"


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unmarked_test_that_starts_a_launcher_fails_and_a_marked_one_passes(tmp_path):
    (tmp_path / "test_starts.py").write_text(
        "import subprocess, pytest\n\n"
        "def start():\n"
        "    try:\n"
        "        subprocess.run(['/nonexistent/bin/deepspeed', '--num_gpus', '2', 'x.py'])\n"
        "    except FileNotFoundError:\n"
        "        pass\n\n"
        "def test_unmarked():\n    start()\n\n"
        "@pytest.mark.launcher\ndef test_marked():\n    start()\n\n"
        "def test_plain():\n    subprocess.run(['true'])\n",
        encoding="utf-8",
    )
    result = _pytest(tmp_path, "test_starts.py")
    assert "1 failed, 2 passed" in result.stdout, result.stdout + result.stderr
    assert "test_unmarked started a slow process without a tier marker (launcher:" in result.stdout


def test_the_quick_tier_collects_no_cluster_launcher_or_hf_test():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--collect-only",
            "-p",
            "no:cacheprovider",
            "-m",
            QUICK,
            "tests/cluster",
            "tests/test_liveness.py",
            "tests/test_hub_export.py",
            "tests/test_model.py",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/test_model.py::") for line in collected), result.stdout[-3000:]
