"""The test tiers of docs/architecture.md (Tests): the markers applied by path in tests/conftest.py, and the guard
that fails a test starting a launcher, a cluster command or .venv-hf without its marker."""

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


@pytest.mark.parametrize("path", sorted(conftest.PATH_MARKERS))
def test_every_marked_path_names_a_folder_file_or_test_that_exists(path):
    """A renamed file or test would silently leave the quick tier's table: each entry must still name one."""
    file, _, test = path.partition("::")
    assert (ROOT / file).exists(), f"tests/conftest.py PATH_MARKERS: {file} does not exist"
    if test:
        tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
        names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
        assert any(name.startswith(test) for name in names), f"PATH_MARKERS: no test {test} in {file}"


def test_markers_follow_the_path():
    assert conftest._path_markers("tests/cluster/test_elastic.py::test_x") == ["cluster"]
    assert conftest._path_markers("tests/test_liveness.py::test_y[a]") == ["launcher"]
    assert conftest._path_markers("tests/test_model.py::test_z") == []


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
