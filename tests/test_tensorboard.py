"""What users look at: a real TensorBoard serving a tiny 2-rank run that was killed and resumed (scalars once per
step, the Text tab's entry per start, the HParams session), the plot command's picture, the ETA and the model
FLOPs in the log line, and a run whose logging breaks mid-run (it warns once and trains on).

One run killed with kill -9 past its step-4 checkpoint and resumed to step 12, and one run whose tensorboard/
folder is replaced by a file mid-run, both started by torchrun (tests/launcher.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.launcher import finish, in_process, records, run, start, torchrun_command, wait_for_step
from txl_dist.training import run_environment

pytestmark = pytest.mark.launcher

TRAIN = "launchers/train.py"
FINAL_STEP = 12
BROKEN_RUN_PEAK = 0.5
TENSORBOARD = Path(sys.executable).parent / "tensorboard"


def _args(shards: Path, output: Path, *extra: str) -> list[str]:
    """The tiny model, every step logged, a sampled evaluation every 4 steps, the full pass at the end (PTB valid in
    36 segments of 64 streams) and a checkpoint every 4."""
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.shards={shards}",
        f"train.output_dir={output}",
        "log.every=1",
        "eval.every=4",
        "eval.batch_size=64",
        "eval.tgt_len=32",
        "checkpoint.every=4",
        "checkpoint.keep_last=0",
        *extra,
    ]


def _kill_tree(process: subprocess.Popen) -> None:
    for member in [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.communicate(timeout=30)


@pytest.fixture(scope="module")
def resumed_run(ptb_word_shards, tmp_path_factory) -> dict:
    """The run killed after logging step 5 or later (so TensorBoard holds steps after its checkpoint of step 4,
    which the resume must purge), then resumed to step 12; with what the first start had logged."""
    output = tmp_path_factory.mktemp("sweep") / "resumed"
    first = start(torchrun_command(TRAIN, _args(ptb_word_shards, output, "train.max_steps=100000")))
    try:
        logged_before = wait_for_step(output, 5, first, timeout=180)
    finally:
        _kill_tree(first)
    resume_step = int((output / "checkpoints" / "latest").read_text().strip().removeprefix("step"))
    result = run(torchrun_command(TRAIN, _args(ptb_word_shards, output, f"train.max_steps={FINAL_STEP}")))
    assert f"at step {resume_step} (exact" in result.stderr
    return {"output": output, "resume_step": resume_step, "logged_before": logged_before, "log": result.stderr}


@pytest.fixture(scope="module")
def broken_run(ptb_word_shards, tmp_path_factory) -> dict:
    """A run (another learning rate, and a peak given for its MFU) whose tensorboard/ folder is replaced by a file
    after its step 3: one process (python launchers/train.py), since the subject is its logger, not its ranks."""
    output = tmp_path_factory.mktemp("sweep_broken") / "broken"
    args = _args(
        ptb_word_shards,
        output,
        "train.max_steps=30",
        "optim.lr=3e-3",
        "eval.every=0",
        "checkpoint.every=0",
        f"train.peak_tflops={BROKEN_RUN_PEAK}",
    )
    process = start([sys.executable, TRAIN, *args])
    wait_for_step(output, 3, process, timeout=180)
    # What TensorBoard held before the folder went (the records up to step 3 are written and flushed by then).
    shutil.copytree(output / "tensorboard", output.parent / "tensorboard_before_removal")
    shutil.rmtree(output / "tensorboard")
    (output / "tensorboard").write_text("not a folder\n")
    log = finish(process, timeout=180)
    return {
        "output": output,
        "returncode": process.returncode,
        "log": log,
        "events_before_removal": output.parent / "tensorboard_before_removal",
    }


# ---- a real TensorBoard ------------------------------------------------------------------------------------------


class Served:
    """`tensorboard --logdir` on loopback (the port it picks itself), its HTTP data API."""

    def __init__(self, logdir: Path, log: Path):
        self.log = log
        self.process = subprocess.Popen(
            [str(TENSORBOARD), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=open(log, "w"),  # noqa: SIM115 -- TensorBoard's own, closed with it
        )
        deadline = time.monotonic() + 90
        while "http://127.0.0.1:" not in log.read_text():
            assert self.process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"TensorBoard did not start:\n{log.read_text()}"
            time.sleep(0.2)
        address = log.read_text().split("http://127.0.0.1:", 1)[1]
        self.base = "http://127.0.0.1:" + address.split("/", 1)[0]

    def get(self, path: str, **query: str):
        url = f"{self.base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        request = urllib.request.Request(
            f"{self.base}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def close(self) -> None:
        tree = psutil.Process(self.process.pid)
        for member in [*tree.children(recursive=True), tree]:
            try:
                member.terminate()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def served(resumed_run, tmp_path_factory):
    server = Served(resumed_run["output"].parent, tmp_path_factory.mktemp("tensorboard_log") / "tensorboard.log")
    run_name = "resumed/tensorboard"
    deadline = time.monotonic() + 90
    while True:  # TensorBoard loads the event files in the background
        tags = server.get("/data/plugin/scalars/tags").get(run_name, {})
        if "train/loss" in tags:
            steps = [step for _, step, _ in server.get("/data/plugin/scalars/scalars", run=run_name, tag="train/loss")]
            if steps and max(steps) == FINAL_STEP:
                break
        assert time.monotonic() < deadline, f"TensorBoard never served step {FINAL_STEP}: {tags}"
        time.sleep(0.5)
    yield server, run_name
    server.close()


def test_every_scalar_once_per_step_after_a_kill_and_a_resume(resumed_run, served):
    server, run_name = served
    assert resumed_run["logged_before"] > resumed_run["resume_step"], "the kill came before any step to purge"
    tags = server.get("/data/plugin/scalars/tags")[run_name]
    logged = records(resumed_run["output"])
    assert sorted(logged) == list(range(1, FINAL_STEP + 1))
    expected_steps = {"train": list(range(1, FINAL_STEP + 1)), "eval": [4, 8, 12], "best": [FINAL_STEP]}
    assert {"train/loss", "train/ppl", "train/lr", "eval/loss", "eval/ppl", "best/loss", "best/ppl"} <= set(tags)
    assert {"train/flops_per_token", "train/tflops"} <= set(tags) and "train/mfu" not in tags  # no peak on a CPU
    for tag in tags:
        points = server.get("/data/plugin/scalars/scalars", run=run_name, tag=tag)
        assert [step for _, step, _ in points] == expected_steps[tag.split("/")[0]], tag
    losses = server.get("/data/plugin/scalars/scalars", run=run_name, tag="train/loss")
    assert all(abs(value - logged[step]["loss"]) < 1e-5 for _, step, value in losses)
    for name in ("flops_per_token", "tflops"):  # float32 scalars
        points = server.get("/data/plugin/scalars/scalars", run=run_name, tag=f"train/{name}")
        assert all(value == pytest.approx(logged[step][name], rel=1e-6) for _, step, value in points), name


def test_the_text_tab_has_one_entry_per_start(resumed_run, served):
    server, run_name = served
    assert set(server.get("/data/plugin/text/tags")[run_name]) == set(run_environment.TEXT_TAGS)
    resume_step = resumed_run["resume_step"]
    entries = {tag: server.get("/data/plugin/text/text", run=run_name, tag=tag) for tag in run_environment.TEXT_TAGS}
    for tag, texts in entries.items():
        assert [entry["step"] for entry in texts] == [0, resume_step], tag
    first, second = (entry["text"] for entry in entries["run/config"])
    assert "max_steps: 100000" in first and f"max_steps: {FINAL_STEP}" in second
    assert "preset: tiny" in first and "global_batch: 8" in first
    environment = entries["run/environment"][1]["text"]
    for row in ("<td>launcher</td>\n<td>torchrun</td>", "<td>world size</td>\n<td>2</td>", "<td>2 (resumed 1 time"):
        assert row in environment, environment
    assert "TORCHELASTIC_RESTART_COUNT=0" in environment and "<td>deepspeed</td>" in environment
    model = entries["run/model"][0]["text"]
    assert "parameters" in model and "peak per rank" in model


def test_the_hparams_dashboard_compares_the_runs_settings_and_results(resumed_run, served):
    server, run_name = served
    experiment = server.post("/data/plugin/hparams/experiment", {"experimentName": ""})
    names = {info["name"] for info in experiment["hparamInfos"]}
    assert names == {
        "model.n_layer",
        "model.d_model",
        "model.n_head",
        "model.tgt_len",
        "model.mem_len",
        "model.dropout",
        "optim.lr",
        "train.global_batch",
        "precision.dtype",
        "zero.stage",
        "world_size",
        "tokenizer",
    }
    metrics = {info["name"]["tag"] for info in experiment["metricInfos"]}
    assert {"eval/loss", "eval/ppl", "best/loss", "best/ppl", "train/loss"} <= metrics
    groups = server.post(
        "/data/plugin/hparams/session_groups",
        {
            "experimentName": "",
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
            "colParams": [],
            "startIndex": 0,
            "sliceSize": 100,
        },
    )["sessionGroups"]
    assert [group["name"] for group in groups] == [run_name]
    hparams = groups[0]["hparams"]
    assert hparams["optim.lr"] == pytest.approx(1e-3) and hparams["world_size"] == 2 and hparams["zero.stage"] == 2
    assert hparams["model.n_layer"] == 2 and hparams["precision.dtype"] == "fp32" and hparams["tokenizer"] == "word"
    assert groups[0]["sessions"][0]["status"] == "STATUS_SUCCESS"
    values = {metric["name"]["tag"]: metric for metric in groups[0]["metricValues"]}
    evaluations = records(resumed_run["output"], "eval")
    assert values["eval/loss"]["trainingStep"] == FINAL_STEP
    assert values["eval/loss"]["value"] == pytest.approx(evaluations[FINAL_STEP]["loss"], rel=1e-6)
    best = evaluations[FINAL_STEP]["loss"]  # the only full pass: the sampled ones are not compared
    assert values["best/loss"]["value"] == pytest.approx(best, rel=1e-6)
    assert values["best/ppl"]["value"] == pytest.approx(math.exp(best), rel=1e-5)


# ---- the log line, the plot ----------------------------------------------------------------------------------------


def test_the_log_line_gives_the_eta_to_max_steps(resumed_run):
    lines = [line for line in resumed_run["log"].splitlines() if " tokens/s" in line and "| loss " in line]
    assert lines and all(f"to step {FINAL_STEP}" in line for line in lines[:-1]), lines
    assert ", ETA " in lines[0] and "ETA" not in lines[-1]  # the last step has nothing left


def test_every_train_record_has_the_model_flops_and_the_log_says_why_mfu_is_null(resumed_run, broken_run):
    """flops_per_token from the formula (docs/metrics.md), tflops per rank from the global tokens/s of 2 ranks, mfu
    null without a peak (and said once per start), tflops / train.peak_tflops with one."""
    resumed = records(resumed_run["output"])
    for record in resumed.values():
        assert record["flops_per_token"] > 0 and "mfu" in record and record["mfu"] is None
        assert record["tflops"] == pytest.approx(record["flops_per_token"] * record["tokens_per_s"] / 2 / 1e12)
    log = resumed_run["log"]
    assert log.count("model FLOPs per token (forward + backward, docs/metrics.md)") == 1
    assert log.count("MFU is not logged: no fp32 peak is known for the device (cpu;") == 1
    assert "set train.peak_tflops" in log
    assert re.search(r"step 12 \| loss .* FLOPs/token \| [0-9.e+-]+ TFLOPS/rank \| MFU - \|", log)
    broken = records(broken_run["output"]).values()
    for record in broken:
        assert record["tflops"] == pytest.approx(record["flops_per_token"] * record["tokens_per_s"] / 1e12)
        assert record["mfu"] == pytest.approx(record["tflops"] / BROKEN_RUN_PEAK)
    assert re.search(r"step 30 \| loss .* TFLOPS/rank \| MFU [0-9.]+% \|", broken_run["log"])
    # The MFU reaches TensorBoard as the scalar train/mfu, equal to the record's (float32), at every step it held.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(broken_run["events_before_removal"]))
    events.Reload()
    assert "train/mfu" in events.Tags()["scalars"], events.Tags()["scalars"]
    mfu = {event.step: event.value for event in events.Scalars("train/mfu")}
    by_step = records(broken_run["output"])
    assert {1, 2} <= set(mfu) <= set(by_step), sorted(mfu)
    for step, value in mfu.items():
        assert math.isfinite(value) and value > 0, (step, value)
        assert value == pytest.approx(by_step[step]["mfu"], rel=1e-6), step
    assert (
        f"{BROKEN_RUN_PEAK:g} TFLOPS peak per rank" in broken_run["log"]
        and "MFU is not logged" not in broken_run["log"]
    )


def test_the_eta_reads_in_hours_minutes_or_seconds():
    from txl_dist.training.step_log import _eta

    assert _eta(4000, 400, 0.1) == ", ETA 6m00s to step 4000"
    assert _eta(100_000, 0, 0.1) == ", ETA 2h46m to step 100000"
    assert _eta(20, 18, 1.0) == ", ETA 2s to step 20"
    assert _eta(20, 20, 0.25) == "" and _eta(None, 5, 1.0) == ""


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def test_plot_draws_one_run_or_several_side_by_side(resumed_run, broken_run, tmp_path):
    from txl_dist.plot import read_run

    resumed = read_run(resumed_run["output"])
    assert resumed.train.steps == list(range(1, FINAL_STEP + 1)) and resumed.eval.steps == [4, 8, 12]
    assert all(b > a for a, b in zip(resumed.train.steps, resumed.train.steps[1:]))
    times = [resumed.x["time"][step] for step in resumed.train.steps]
    assert all(b >= a for a, b in zip(times, times[1:])), times  # the time between the kill and the resume left out
    one, two, steps_only = tmp_path / "one.png", tmp_path / "two.png", tmp_path / "step.png"
    in_process("txl_dist/plot.py", str(resumed_run["output"]), "--out", str(one))
    result = in_process("txl_dist/plot.py", str(resumed_run["output"]), str(broken_run["output"]), "--out", str(two))
    assert str(two) in result.stdout
    in_process("txl_dist/plot.py", str(resumed_run["output"]), "--x", "step", "--out", str(steps_only))
    width, height = _png_size(one)
    assert width == _png_size(two)[0] and width > 1200 and height > 600
    assert _png_size(two)[1] >= height  # the legend below the panels grows with the runs it names
    assert _png_size(steps_only)[0] < width * 0.7  # one column of panels (as wide as the legend's longest name)
    assert one.read_bytes() != two.read_bytes()
    assert one.stat().st_size > 20_000


def test_plot_errors_are_one_line(resumed_run, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    cases = {
        (str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")): "missing: no such run directory",
        (str(blocked), "--out", str(tmp_path / "x.png")): "a_file: a file, not a run directory",
        (str(tmp_path), "--out", str(tmp_path / "x.png")): "metrics.jsonl: no such file",
        (str(empty), "--out", str(tmp_path / "x.png")): "metrics.jsonl: no training step logged yet",
        (str(resumed_run["output"]), "--out", str(blocked / "x.png")): f"no such directory {blocked}",
        (str(resumed_run["output"]), "--out", str(tmp_path)): "a directory, not a file",
        (str(resumed_run["output"]), "--out", str(tmp_path / "x.jpg")): "name it *.png",
    }
    for argv, message in cases.items():
        result = in_process("txl_dist/plot.py", *argv, check=False)
        assert result.returncode == 2 and message in result.stderr, (argv, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "x.png").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the extra is not installed
    result = in_process("txl_dist/plot.py", str(resumed_run["output"]), "--out", str(tmp_path / "x.png"), check=False)
    assert result.returncode == 2 and "pip install 'txl_dist[plot]'" in result.stderr


# ---- logging never kills training ---------------------------------------------------------------------------------


def test_a_tensorboard_folder_replaced_mid_run_warns_once_and_the_run_finishes(broken_run):
    output, log = broken_run["output"], broken_run["log"]
    assert broken_run["returncode"] == 0, log[-3000:]
    warnings = [line for line in log.splitlines() if "logging: tensorboard failed" in line]
    assert len(warnings) == 1, warnings
    assert "removed or replaced while the run was writing it" in warnings[0] and "training goes on" in warnings[0]
    assert "Traceback" not in log
    assert (output / "checkpoints" / "latest").read_text().strip() == "step00000030"
    assert f"checkpoint {output / 'checkpoints' / 'step00000030'} written" in log
    assert sorted(records(output)) == list(range(1, 31))  # metrics.jsonl went on


def test_a_metrics_file_removed_or_a_tensorboard_path_taken_warns_once(tmp_path, caplog):
    """The run logger in this process: metrics.jsonl removed after the first record, then replaced by a file;
    tensorboard/ a file from the start. One warning each; the sinks that work go on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from txl_dist.training.run_log import RunLogger

    caplog.set_level(logging.WARNING, logger="txl_dist.training")
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "tensorboard").write_text("in the way\n")
    blocked = RunLogger(tmp_path / "blocked", enabled=True, tensorboard=True)
    blocked.record(1, "train", {"loss": 2.0})
    blocked.close()
    assert [r["loss"] for r in records(tmp_path / "blocked").values()] == [2.0]

    logger = RunLogger(tmp_path / "run", enabled=True, tensorboard=True)
    logger.record(1, "train", {"loss": 3.0})
    (tmp_path / "run" / "metrics.jsonl").unlink()
    for step in (2, 3):
        logger.record(step, "train", {"loss": 3.0 - step / 10})
    (tmp_path / "run" / "metrics.jsonl").write_text("someone else's\n")
    logger.record(4, "train", {"loss": 2.5})
    logger.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "logging: tensorboard failed at the start" in warnings[0] and "tensorboard" in warnings[0]
    assert "logging: metrics.jsonl failed at step 2" in warnings[1] and "removed or replaced" in warnings[1]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
