"""The error policy of every command (docs/architecture.md, Rules; `txl_dist.exit_status`): a refused input exits 2
with one line naming the bad file, key or value; an unknown flag exits 2; a runtime failure exits 1; Ctrl-C 130.

Each command runs through its real ``__main__`` block (`runpy`, in this process: no new interpreter and no second
import of torch per case), on real bad inputs; nothing trains and no launcher starts.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from txl_dist import exit_status
from txl_dist.data.format import MANIFEST_NAME

REPO = Path(__file__).resolve().parents[1]


def run_main(target: str, *args: str, capsys) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of ``python TARGET ARGS`` (a script path) or ``python -m TARGET ARGS``."""
    saved = sys.argv
    sys.argv = [target, *args]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a module run again after its import
            if target.endswith(".py"):
                runpy.run_path(str(REPO / target), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exited:
        status = exited.code if isinstance(exited.code, int) else 1
    finally:
        sys.argv = saved
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def corrupt_shards(ptb_word_shards, tmp_path) -> Path:
    """A copy of the PTB shards whose manifest is not JSON."""
    copy = tmp_path / "shards"
    shutil.copytree(ptb_word_shards, copy)
    (copy / MANIFEST_NAME).write_text('{"version": ')
    return copy


def _refused(target: str, args: list[str], named: str, capsys) -> None:
    status, lines = run_main(target, *args, capsys=capsys)
    assert status == exit_status.USAGE_ERROR, (status, lines)
    assert len(lines) == 1 and named in lines[0] and ": error: " in lines[0], lines
    assert "Traceback" not in lines[0]


def test_every_command_refuses_a_bad_input_with_one_line_and_status_2(
    ptb_word_shards, ptb_word_tokenizer, corrupt_shards, tmp_path, capsys
):
    missing = str(tmp_path / "missing")
    manifest = str(corrupt_shards / MANIFEST_NAME)
    cases = [
        ("launchers/train.py", ["--config", f"{missing}.yaml"], f"{missing}.yaml"),
        ("launchers/train.py", ["--config", "configs/tiny_cpu.yaml", "train.max_steps=-3"], "train.max_steps"),
        ("launchers/evaluate.py", [missing], missing),
        ("launchers/convert.py", ["export-to-hf", missing, str(tmp_path / "out")], missing),
        ("launchers/generate.py", [str(tmp_path), "--prompt", "the", "--num-samples", "0"], "--num-samples 0"),
        (
            "data_tools.build_shards",
            ["--tokenizer", str(ptb_word_tokenizer), "--output", str(tmp_path / "s"), "--split", f"train={missing}"],
            missing,
        ),
        (
            "data_tools.train_tokenizer",
            ["--kind", "word", "--input", missing, "--output", str(tmp_path / "t")],
            missing,
        ),
        ("data_tools.inspect_shards", [str(corrupt_shards)], manifest),
        ("benchmarks.corpora.synthetic_lm1b", ["--output", str(tmp_path / "l"), "--scale", "-1"], "scale -1"),
        (
            "benchmarks.corpora.synthetic_charlm",
            ["text8", "--output", str(tmp_path / "c"), "--bytes", "0"],
            "--bytes 0",
        ),
        ("txl_dist.plan", ["--config", "configs/tiny_cpu.yaml", "--world-size", "0"], "--world-size 0"),
        (
            "txl_dist.plan",
            ["--config", "configs/tiny_cpu.yaml", "--world-size", "1", f"data.shards={corrupt_shards}"],
            manifest,
        ),
        ("txl_dist.plot", [missing, "--out", str(tmp_path / "x.png")], missing),
        ("txl_dist.rendezvous.launch_env", ["--hostfile", missing], missing),
    ]
    for target, args, named in cases:
        _refused(target, args, named, capsys)
    assert not (tmp_path / "out").exists() and not (tmp_path / "s" / MANIFEST_NAME).exists()


@pytest.mark.parametrize(
    "target",
    [
        "launchers/train.py",
        "launchers/evaluate.py",
        "launchers/convert.py",
        "launchers/generate.py",
        "data_tools.build_shards",
        "data_tools.train_tokenizer",
        "data_tools.inspect_shards",
        "benchmarks.corpora.synthetic_lm1b",
        "benchmarks.corpora.synthetic_charlm",
        "txl_dist.plan",
        "txl_dist.plot",
        "txl_dist.rendezvous.launch_env",
        "txl_dist.rendezvous.process_group",
    ],
)
def test_an_unknown_flag_exits_2(target, capsys):
    status, lines = run_main(target, "--bogus-flag", capsys=capsys)
    assert status == exit_status.USAGE_ERROR and lines and "error: " in lines[-1], (status, lines)
    assert "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--bogus", "--cases", "no_such_case"], "unrecognized arguments: --bogus"),
        (["--cases", "no_such_case,tiny_zero2"], "--cases: no case 'no_such_case'; the cases: tiny_zero2, "),
    ],
)
def test_a_benchmark_refuses_an_unknown_flag_or_case_before_it_runs_anything(args, named, tmp_path):
    """benchmarks/plan_check.py passes unknown flags on to the trainer only as a probe (--probe); as the
    benchmark, an unknown flag or case is argparse's refusal (status 2), not minutes of runs that ignore it.
    (The unknown case keeps the test short on a script that would ignore the flag.)"""
    work = tmp_path / "work"
    completed = subprocess.run(
        [sys.executable, "benchmarks/plan_check.py", *args, "--work-dir", str(work)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = completed.stderr.strip().splitlines()
    assert completed.returncode == exit_status.USAGE_ERROR, (completed.returncode, lines)
    assert lines[-1] == f"plan_check.py: error: {named}" or lines[-1].startswith(f"plan_check.py: error: {named}")
    assert not work.exists()  # nothing built


def test_the_op_build_command_prints_its_help_without_building(capsys):
    """``python -m txl_dist.rendezvous.process_group --help`` is help and exit 0, not the build of DeepSpeed's op."""
    saved = sys.argv
    sys.argv = ["txl_dist.rendezvous.process_group", "--help"]
    try:
        with warnings.catch_warnings(), pytest.raises(SystemExit) as exited:
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module("txl_dist.rendezvous.process_group", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved
    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert out.startswith("usage: python -m txl_dist.rendezvous.process_group") and " op: " not in out, out


def _refuses_writes(folder: Path) -> bool:
    try:
        (folder / ".txl_dist-probe").write_text("")
    except PermissionError:
        return True
    except OSError:
        return False
    (folder / ".txl_dist-probe").unlink()
    return False


def test_a_write_the_surroundings_refuse_is_a_runtime_failure_with_one_line(capsys):
    """/sys refuses new files even to root: permission denied, a failure of the surroundings (1), not of input."""
    if not _refuses_writes(Path("/sys")):
        pytest.skip("/sys accepts new files here, or refuses them for another reason")
    status, lines = run_main(
        "benchmarks.corpora.synthetic_charlm", "text8", "--output", "/sys/text8", "--bytes", "100", capsys=capsys
    )
    assert status == exit_status.FAILURE and lines == ["synthetic_charlm: error: /sys/text8: permission denied"]


def test_verdicts_have_a_status_of_their_own(ptb_word_shards, tmp_path, capsys):
    """A check that ran and answers no exits 3: damaged shards, a layout that does not fit."""
    copy = tmp_path / "shards"
    shutil.copytree(ptb_word_shards, copy)
    entry = json.loads((copy / MANIFEST_NAME).read_text())["splits"]["valid"]["shards"][0]
    shard = copy / entry["path"]
    shard.write_bytes(shard.read_bytes()[:-512])
    status, _ = run_main("data_tools.inspect_shards", str(copy), "--verify", "--no-progress", capsys=capsys)
    assert status == exit_status.VERDICT
    args = ["--config", "configs/tiny_cpu.yaml", "--device", "cpu", "--world-size", "2"]
    assert run_main("txl_dist.plan", *args, "--device-memory", "1MiB", capsys=capsys)[0] == exit_status.VERDICT
    assert run_main("txl_dist.plan", *args, "--device-memory", "4GiB", capsys=capsys)[0] == 0


# ---- a reader that leaves: `| head -1` ------------------------------------------------------------------------


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` writing into a pipe whose reader has gone, as ``| head -1`` leaves it after its line (here
    before the first write, so that every write meets the closed pipe)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(
            [sys.executable, *args], stdout=writer, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300
        )
    finally:
        os.close(writer)


READER_LEAVES = {
    "inspect_shards": lambda shards, export, tmp: ["-m", "data_tools.inspect_shards", str(shards), "--decode", "3"],
    "generate": lambda shards, export, tmp: [
        "launchers/generate.py",
        str(export),
        "--prompt",
        "the",
        "--max-new-tokens",
        "5",
    ],
    "generate --score": lambda shards, export, tmp: [
        "launchers/generate.py",
        str(export),
        "--score",
        "the market",
        "a share",
    ],
    "plan": lambda shards, export, tmp: [
        "-m",
        "txl_dist.plan",
        "--config",
        "configs/tiny_cpu.yaml",
        "--world-size",
        "1",
        "--device",
        "cpu",
    ],
    "synthetic_charlm": lambda shards, export, tmp: [
        "-m",
        "benchmarks.corpora.synthetic_charlm",
        "text8",
        "--output",
        str(tmp / "text8"),
        "--bytes",
        "1000",
    ],
    "build_shards --help": lambda shards, export, tmp: ["-m", "data_tools.build_shards", "--help"],
}
"""The commands whose output meets a reader that has left: a line of the output, the last flush at exit, a --help."""


@pytest.mark.parametrize("command", list(READER_LEAVES))
def test_a_command_whose_reader_leaves_ends_quietly_with_status_0(command, ptb_word_shards, ptb_export, tmp_path):
    """The reader's choice, as for `yes | head`: no "error: Broken pipe", no traceback, status 0, whichever
    write (a line of the output, the last flush at exit, a --help) meets the closed pipe."""
    args = READER_LEAVES[command](ptb_word_shards, ptb_export, tmp_path)
    result = _into_a_closed_pipe(*args)
    assert (result.returncode, result.stderr) == (0, ""), (args, result.returncode, result.stderr[-2000:])
    if command == "synthetic_charlm":
        assert (tmp_path / "text8").exists()  # the work itself was done: only its summary line had no reader


def test_head_1_after_the_first_sample_of_generate_stops_it_quietly(ptb_export):
    """The real pipe: `head -1` leaves after the first sample's line, while generate.py writes the others."""
    command = (
        f"{sys.executable} launchers/generate.py {ptb_export} --prompt the --num-samples 30 --max-new-tokens 40 "
        "--seed 1 | head -1; exit ${PIPESTATUS[0]}"
    )
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert (result.returncode, result.stderr) == (0, ""), result
    assert result.stdout.startswith("the ") and result.stdout.count("\n") == 1


def test_a_broken_pipe_of_anything_but_stdout_is_still_a_failure(capsys):
    """A worker's pipe that breaks is a failure of the surroundings (1), not a reader's choice."""
    assert exit_status.run_command(_raising(BrokenPipeError(32, "Broken pipe")), "cmd", []) == exit_status.FAILURE
    assert capsys.readouterr().err == "cmd: error: Broken pipe\n"


# ---- the helper itself -------------------------------------------------------------------------------------------


def _raising(error: BaseException):
    def main(argv=None):
        raise error

    return main


def test_run_command_maps_each_kind_of_ending_to_its_status(tmp_path, capsys):
    run = exit_status.run_command
    assert run(lambda argv: 0, "cmd", []) == 0 and run(lambda: None, "cmd") == 0
    assert run(lambda argv: exit_status.VERDICT, "cmd", []) == 3
    assert run(_raising(ValueError("--size 0: must be positive\n(a second line)")), "cmd", []) == 2
    assert capsys.readouterr().err == "cmd: error: --size 0: must be positive (a second line)\n"
    assert run(_raising(FileNotFoundError(2, "No such file or directory", str(tmp_path / "in"))), "cmd", []) == 2
    assert capsys.readouterr().err == f"cmd: error: {tmp_path / 'in'}: no such file or directory\n"
    assert run(_raising(FileNotFoundError(f"{tmp_path}/config.json: missing")), "cmd", []) == 2
    assert run(_raising(OSError(28, "No space left on device", str(tmp_path / "out"))), "cmd", []) == 1
    assert capsys.readouterr().err.endswith(f"cmd: error: {tmp_path / 'out'}: no space left on device\n")
    assert run(_raising(exit_status.CommandFailure("worker 3 died (SIGKILL)")), "cmd", []) == 1
    assert capsys.readouterr().err == "cmd: error: worker 3 died (SIGKILL)\n"
    assert run(_raising(KeyboardInterrupt()), "cmd", []) == 130
    assert capsys.readouterr().err == "cmd: interrupted\n"
    assert run(_raising(SystemExit(2)), "cmd", []) == 2
    assert run(_raising(RuntimeError("a bug")), "cmd", []) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.splitlines()[-1].startswith(
        "cmd: error: internal error (RuntimeError: a bug)"
    )


def test_a_dead_worker_is_a_known_failure():
    from data_tools.workers import WorkerError

    assert issubclass(WorkerError, exit_status.CommandFailure) and exit_status.exit_status(WorkerError("x")) == 1
