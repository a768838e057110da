"""launchers/train.py through the real `deepspeed` launcher on 2 CPU ranks (gloo), on Penn Treebank shards.

The reference run (the session's ``reference`` fixture, tests/conftest.py) trains the tiny model for 40 steps with
dropout (so resuming must restore the RNG too); the other runs stop, get killed, resume, change the number of
ranks, and are compared with it step by step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.launcher import (
    REFERENCE_COMMAND,
    REPO,
    STEPS,
    TRAIN,
    copy_at_step,
    finish,
    free_port,
    in_process,
    launcher_command,
    rank_processes,
    records,
    run,
    shm_buffers_left,
    start,
    tail,
    torchrun_command,
    wait_for_step,
)
from tests.launcher import tiny_args as args
from txl_dist.training.throughput import known_peak

pytestmark = pytest.mark.launcher


@pytest.fixture(scope="module")
def first_half(reference, tmp_path_factory) -> Path:
    """The reference run as it was after its step-20 checkpoint (read-only: copy it to resume from it)."""
    return copy_at_step(reference, 20, tmp_path_factory.mktemp("first_half") / "run")


def latest(output_dir: Path) -> str:
    return (output_dir / "checkpoints" / "latest").read_text().strip()


def test_reference_run_trains_and_reports(reference):
    logged = records(reference)
    assert sorted(logged) == list(range(1, STEPS + 1))
    for record in logged.values():
        for key in (
            "loss",
            "ppl",
            "lr",
            "tokens",
            "grad_norm",
            "tokens_per_s",
            "step_time_s",
            "rss_mb",
            "data_checksum",
        ):
            assert key in record, key
    assert logged[STEPS]["tokens"] == STEPS * 8 * 8  # global batch 8 x tgt_len 8
    first = sum(logged[s]["loss"] for s in range(1, 6)) / 5
    last = sum(logged[s]["loss"] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < first - 0.3, (first, last)
    evals = records(reference, "eval")
    assert list(evals) == [STEPS] and evals[STEPS]["targets"] == 73760 - 1  # PTB valid, every target once
    assert latest(reference) == "step00000040"
    # DeepSpeed's shared-memory all-reduce buffers (2 x 66 MiB) are the run's to remove, not the node's reboot.
    assert shm_buffers_left(REFERENCE_COMMAND) == []


def test_exact_resume_gives_identical_losses(reference, first_half, ptb_word_shards, tmp_path):
    output = tmp_path / "resumed"
    shutil.copytree(first_half, output)
    result = run(torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={STEPS}")))
    assert "resumed from" in result.stderr and "at step 20 (exact" in result.stderr
    straight, resumed = records(reference), records(output)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step]["data_checksum"] == straight[step]["data_checksum"], step
        assert resumed[step]["loss"] == straight[step]["loss"], step


def test_a_signal_to_one_rank_stops_both_and_validation_leaves_training_unchanged(reference, ptb_word_shards, tmp_path):
    """SIGINT to rank 1 alone, then (after resuming) SIGTERM to rank 0 alone: the stop-flag all-reduce stops both
    ranks after the same step, which is checkpointed, and the run resumes exactly. Meanwhile full validation
    passes every 8 steps, with other memory settings than training's (mem_len 32, clamp_len 6, same_length), leave
    every training loss equal to that of the reference run, which never validates; and keep_last=1 rotation keeps
    the newest checkpoint and the best one, nothing else."""
    from txl_dist.convert.zero import read_training_checkpoint

    output = tmp_path / "validated"
    extra = [
        "eval.every=8",
        "eval.max_batches=0",
        "eval.batch_size=64",
        "eval.tgt_len=32",
        "eval.mem_len=32",
        "eval.clamp_len=6",
        "eval.same_length=true",
        "checkpoint.every=2",
        "checkpoint.keep_last=1",
        "train.max_steps=400",
    ]
    straight = records(reference)
    for rank, signum, after in ((1, signal.SIGINT, 10), (0, signal.SIGTERM, None)):
        process = start(torchrun_command(TRAIN, args(ptb_word_shards, output, *extra)))
        resumed_from = max(records(output), default=0)
        wait_for_step(output, after or resumed_from + 4, process)
        rank_processes(process)[rank].send_signal(signum)
        out = finish(process)
        assert process.returncode == 0, out[-3000:]
        # Rank 0 writes the summary: its own signal, or the other rank's stop request.
        assert ("stopped by SIGTERM" if rank == 0 else "stopped by a stop request on another rank") in out, out[-3000:]
        if resumed_from:
            assert f"at step {resumed_from} (exact" in out
        logged = records(output)
        stopped_at = max(logged)
        assert sorted(logged) == list(range(1, stopped_at + 1)) and stopped_at <= STEPS
        for step in range(1, stopped_at + 1):
            assert logged[step]["loss"] == straight[step]["loss"], step

        evaluations = records(output, "eval")
        assert sorted(evaluations) == list(range(8, stopped_at + 1, 8))
        assert all(e["targets"] == 73760 - 1 for e in evaluations.values())
        best = min(evaluations, key=lambda step: evaluations[step]["loss"])
        checkpoints = output / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step")) == sorted(
            {f"step{stopped_at:08d}", f"step{best:08d}"}
        )
        assert latest(output) == f"step{stopped_at:08d}"
        _check_complete(checkpoints / latest(output), stopped_at, reference)
        client = read_training_checkpoint(output).client
        assert client["best"]["step"] == best and client["best"]["loss"] == evaluations[best]["loss"]


def _check_complete(tag_dir: Path, step: int, reference: Path) -> None:
    """COMPLETE.json of a 2-rank checkpoint: its step, ranks, streams and architecture (the reference run's), and a
    checksum for every file in the folder, which all verify."""
    from txl_dist.checkpoints.verify import verify_checkpoint

    marker = json.loads((tag_dir / "COMPLETE.json").read_text())
    expected_architecture = json.loads((reference / "checkpoints" / "step00000040" / "COMPLETE.json").read_text())
    assert (marker["step"], marker["world_size"], marker["streams_per_rank"]) == (step, 2, 4)
    assert marker["rank_states"] == ["rank00000.pt", "rank00001.pt"]
    assert (
        marker["architecture"] == expected_architecture["architecture"] and marker["architecture"]["n_token"] == 10000
    )
    on_disk = sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_file())
    assert sorted(marker["files"]) == [name for name in on_disk if name != "COMPLETE.json"]
    # DeepSpeed's files: the module, and one optimizer partition per rank (named bf16_zero_pp_rank_* under bf16).
    assert "mp_rank_00_model_states.pt" in marker["files"]
    assert sorted(name.removeprefix("bf16_") for name in marker["files"] if name.endswith("_optim_states.pt")) == [
        f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(2)
    ]
    assert verify_checkpoint(tag_dir) == []


def test_kill9_fails_the_launcher_and_resume_uses_the_last_complete_checkpoint(reference, ptb_word_shards, tmp_path):
    output = tmp_path / "killed"
    command = launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=400", "checkpoint.every=5"))
    process = start(command)
    wait_for_step(output, 12, process)
    rank_processes(process)[1].kill()
    out = finish(process)
    assert process.returncode != 0
    assert shm_buffers_left(command) == []  # not even the killed rank's
    # One line from the ranks that name the dead one (not the 36 lines of gloo's "Connection reset by peer").
    errors = [line for line in out.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1 and errors[0].startswith("train.py: error: rank 1 (") and " died " in errors[0], out[-4000:]
    recorded = [json.loads(line) for line in (output / "faults.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"], r["reporter"], r["message"]) for r in recorded] == [("died", 1, 0, errors[0])]
    assert "SIGKILL" in errors[0] and "since its last checkpoint (step" in errors[0], errors
    assert "Traceback" not in out and "Connection reset" not in out, out[-4000:]
    complete = latest(output)
    assert (output / "checkpoints" / complete / "COMPLETE.json").is_file()
    step = int(complete.removeprefix("step"))
    assert step >= 10

    # A save cut short by the kill leaves a folder without COMPLETE.json; even a `latest` naming such a folder
    # (which the trainer itself never writes) must not be resumed from.
    half_written = output / "checkpoints" / "step00000099"
    shutil.copytree(output / "checkpoints" / complete, half_written)
    (half_written / "COMPLETE.json").unlink()
    (half_written / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    (output / "checkpoints" / "latest").write_text("step00000099\n")

    result = run(torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={step + 3}")))
    assert f"at step {step} (exact" in result.stderr
    assert not half_written.exists()
    straight, resumed = records(reference), records(output)
    for s in range(step + 1, step + 4):
        assert resumed[s]["loss"] == straight[s]["loss"], s


def test_tensorboard_has_the_scalars(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        f"train/{name}"
        for name in (
            "loss",
            "ppl",
            "lr",
            "grad_norm",
            "tokens",
            "tokens_per_s",
            "step_time_s",
            "rss_mb",
            "skipped_steps",
        )
    }
    expected |= {"eval/loss", "eval/ppl"}
    assert expected <= tags, expected - tags
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, STEPS + 1))
    logged = records(reference)
    assert all(abs(e.value - logged[e.step]["loss"]) < 1e-5 for e in losses)


def _consolidated(output: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(output / "checkpoints"), tag=latest(output))


def test_zero_stages_train_and_agree(reference, ptb_word_shards, tmp_path):
    """ZeRO 1 and 3 in fp32 give the same weights after the same steps from the same seed; ZeRO 2 bf16 trains."""
    outputs = {}
    for name, variant in (("zero1", "zero1"), ("zero3", "zero3"), ("zero2_bf16", "zero2")):
        outputs[name] = tmp_path / name
        extra = ["--config", f"configs/variants/{variant}.yaml", "train.max_steps=20", "model.dropout=0.0"]
        if variant == "zero3":
            # Else every parameter of the tiny model stays whole on every rank. Partitioned, each forward gathers
            # every parameter: the final validation pass in 19 segments of 64 tokens (64 streams).
            extra += ["zero.stage3_param_persistence_threshold=0", "eval.tgt_len=64"]
        if name.endswith("bf16"):
            extra += ["--config", "configs/variants/bf16.yaml"]
        run(torchrun_command(TRAIN, args(ptb_word_shards, outputs[name], *extra)))
    for name, output in outputs.items():
        logged = records(output)
        first = sum(logged[s]["loss"] for s in range(1, 4)) / 3
        last = sum(logged[s]["loss"] for s in range(18, 21)) / 3
        assert last < first - 0.5, (name, first, last)
    zero1, zero3 = _consolidated(outputs["zero1"]), _consolidated(outputs["zero3"])
    assert sorted(zero1) == sorted(zero3)
    max_difference = max((zero1[k] - zero3[k]).abs().max().item() for k in zero1)
    print(f"max |ZeRO-1 - ZeRO-3| over all weights after 20 steps: {max_difference:.3e}")
    assert max_difference < 1e-4
    _check_complete(outputs["zero2_bf16"] / "checkpoints" / latest(outputs["zero2_bf16"]), 20, reference)


def test_two_nodes_of_one_process_on_localhost(reference, ptb_word_shards, tmp_path):
    """Multi-node start as on a cluster without ssh: one `deepspeed --no_ssh --node_rank N` per node. Two nodes of
    one rank are the reference run's two ranks: the same streams, dropout seeds and losses."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    output = tmp_path / "two_nodes"
    port = str(free_port())
    node_args = args(ptb_word_shards, output, "train.max_steps=6")
    nodes = [
        start(
            launcher_command(
                TRAIN,
                node_args,
                launcher_flags=[
                    "--hostfile",
                    str(hostfile),
                    "--no_ssh",
                    "--node_rank",
                    str(rank),
                    "--master_addr",
                    "127.0.0.1",
                    "--master_port",
                    port,
                ],
            )
        )
        for rank in (0, 1)
    ]
    outs = [finish(node, timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "on 2 rank(s)" in outs[0]
    straight, two_nodes = records(reference), records(output)
    assert sorted(two_nodes) == list(range(1, 7))
    for step in range(1, 7):
        assert two_nodes[step]["data_checksum"] == straight[step]["data_checksum"], step
        assert two_nodes[step]["loss"] == straight[step]["loss"], step


def _refused_in_process(argv: list[str], capsys, monkeypatch) -> str:
    """launchers/train.py's main called in this process with ``argv``, which it must refuse before any process
    group or output exists, giving the signal handlers back: its one error line."""
    import torch.distributed as dist

    from launchers import train
    from txl_dist.training import startup

    def started(*_) -> None:  # were the arguments accepted, a run would start in this process
        pytest.fail(f"launchers/train.py accepted {argv}")

    monkeypatch.setattr(startup, "apply_launch", started)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as exited:
        train.main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines) and lines[-1].startswith("launchers/train.py: error: "), lines
    assert not dist.is_initialized() and signal.getsignal(signal.SIGINT) is handler
    return lines[-1]


def test_bad_config_fails_before_any_process_group(ptb_word_shards, tmp_path, capsys, monkeypatch):
    error = _refused_in_process(args(ptb_word_shards, tmp_path / "bad", "train.micro_batch=3"), capsys, monkeypatch)
    assert error.startswith("launchers/train.py: error: train.micro_batch") and "global_batch" in error, error
    assert not (tmp_path / "bad").exists()


def test_another_architecture_a_fresh_start_and_another_tokenizer_are_refused_before_start_up(
    first_half, ptb_word_shards, tmp_path, capsys, monkeypatch
):
    """What the trainer would find only after every rank started is refused by the command line, from the files:
    the run directory's newest checkpoint has another architecture, or checkpoints are there under
    checkpoint.resume=false, or data.tokenizer is not the shards' tokenizer. Nothing in the run changes."""
    from data_tools import train_tokenizer

    output = tmp_path / "changed"
    shutil.copytree(first_half, output)
    before = sorted(p.relative_to(output).as_posix() for p in output.rglob("*"))

    def refused(argv):
        return _refused_in_process(argv, capsys, monkeypatch)

    error = refused(args(ptb_word_shards, output, "train.max_steps=30", "model.d_inner=48"))
    assert error.endswith(
        f"{output / 'checkpoints' / 'step00000020'} was trained with another architecture: "
        f"d_inner: checkpoint 32, config 48"
    ), error
    error = refused(args(ptb_word_shards, output, "train.max_steps=30", "checkpoint.resume=false"))
    assert error.endswith(
        f"checkpoint.resume=false, but {output / 'checkpoints'} holds checkpoints (newest "
        f"step00000020): choose another train.output_dir, or remove them"
    ), error
    # A damaged newest marker is left to the trainer's verification (which then looks at older checkpoints).
    damaged = tmp_path / "damaged_marker"
    shutil.copytree(first_half, damaged)
    (damaged / "checkpoints" / "step00000020" / "COMPLETE.json").write_text("{")
    from txl_dist.training.startup import parse_run_args

    parse_run_args(args(ptb_word_shards, damaged, "model.d_inner=48"), world_size=2, device="cpu")

    (tmp_path / "other.txt").write_text("a few other words\n")
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "word",
                "--input",
                str(tmp_path / "other.txt"),
                "--output",
                str(tmp_path / "other_tokenizer"),
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    error = refused(
        args(ptb_word_shards, tmp_path / "other", "train.max_steps=4", f"data.tokenizer={tmp_path / 'other_tokenizer'}")
    )
    assert f"data.tokenizer='{tmp_path / 'other_tokenizer'}': its fingerprint " in error, error
    assert "the shards were built with another tokenizer" in error and str(ptb_word_shards / "manifest.json") in error
    assert sorted(p.relative_to(output).as_posix() for p in output.rglob("*")) == before
    assert not (tmp_path / "other").exists()


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (DeepSpeed refuses fp16 on its CPU "
    "accelerator); the model's fp16 paths are tested with autocast in test_model.py",
)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_training_on_gpus(precision, ptb_word_shards, tmp_path):
    """On a CUDA machine: ZeRO 2 over NCCL with torch's fused Adam; fp16 with dynamic loss scaling, or bf16."""
    n_gpus = min(2, torch.cuda.device_count())
    output = tmp_path / precision
    command = launcher_command(
        TRAIN,
        args(
            ptb_word_shards,
            output,
            "--config",
            f"configs/variants/{precision}.yaml",
            "train.max_steps=30",
            "model.dropout=0.0",
            f"train.micro_batch={8 // n_gpus // 2}",
        ),
        nprocs=n_gpus,
    )
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # the CUDA accelerator, not the CPU's
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, tail(result)
    logged = records(output)
    if precision == "fp16":
        assert all(record["loss_scale"] >= 1 for record in logged.values())
        # Overflowing steps are skipped while the scale settles, then it trains.
        assert logged[30]["skipped_steps"] < 15
    else:
        assert logged[30]["skipped_steps"] == 0 and logged[30].get("loss_scale") is None
    assert "max_allocated_mb" in logged[30] and "max_reserved_mb" in logged[30]
    # MFU against the datasheet's dense peak where the device is in the table (A100, H100, H200, B200).
    peak = known_peak(torch.cuda.get_device_name(), precision)
    assert logged[30]["mfu"] == (None if peak is None else pytest.approx(logged[30]["tflops"] / peak))
    assert logged[30]["loss"] < logged[1]["loss"] - 0.5
    if precision == "fp16":
        # The fp16 optimizer state (DeepSpeed's loss scaler objects) reads back weights-only, in training and in
        # a conversion.
        resumed = subprocess.run(
            [c.replace("train.max_steps=30", "train.max_steps=32") for c in command],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert resumed.returncode == 0 and "at step 30 (exact" in resumed.stderr, tail(resumed)
        converted = subprocess.run(
            [sys.executable, "launchers/convert.py", "zero-to-export", str(output), str(tmp_path / "export")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        assert converted.returncode == 0, tail(converted)


def test_a_shard_damaged_where_only_rank_1_reads_stops_every_rank_with_one_message(ptb_word_shards, tmp_path):
    """Only rank 1 reads the damaged shard: every rank stops, the error is printed once, with no traceback."""
    shards = tmp_path / "shards"
    shutil.copytree(ptb_word_shards, shards)
    _overwrite_middle(shards / "train-000005.tar", size=64)  # rank 1's third stream starts in it
    command = launcher_command(TRAIN, args(shards, tmp_path / "damaged_shard", "train.max_steps=4"))
    result = run(command, check=False)
    assert result.returncode != 0
    assert shm_buffers_left(command) == []
    _one_error(tail(result, 300), "train.py: error on rank 1 (")
    assert "train-000005.tar" in tail(result, 300)
    # Recorded as a refusal of the input, which the Slurm batch script never retries (txl_dist.supervision.faults).
    recorded = [json.loads(line) for line in (tmp_path / "damaged_shard" / "faults.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rank"]) for r in recorded] == [("refused", 1)] and "train-000005.tar" in recorded[0][
        "message"
    ]


# ---- run integrity (issue 10) --------------------------------------------------------------------------------


def _overwrite_middle(path: Path, size: int = 4096) -> None:
    """Damage a file in place, its size unchanged: 0xff bytes are NaN as floats."""
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        handle.write(b"\xff" * size)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _one_error(text: str, fragment: str) -> None:
    """``fragment`` is in exactly one line, which is a train.py error, and no rank printed a traceback or a gloo
    error."""
    lines = [line for line in text.splitlines() if fragment in line]
    assert len(lines) == 1 and lines[0].startswith("train.py: error"), text[-3000:]
    assert "Traceback" not in text and "gloo/transport" not in text and "Connection closed" not in text, text[-3000:]


def test_damaged_checkpoints_are_skipped_and_never_rotate_the_good_one_out(reference, ptb_word_shards, tmp_path):
    output = tmp_path / "damaged"
    shutil.copytree(reference, output)
    checkpoints = output / "checkpoints"
    _overwrite_middle(checkpoints / "step00000040" / "mp_rank_00_model_states.pt")
    _truncate(checkpoints / "step00000030" / "txl_rank_states" / "rank00001.pt")
    _truncate(checkpoints / "step00000020" / "mp_rank_00_model_states.pt")
    _overwrite_middle(checkpoints / "step00000020" / "txl_rank_states" / "rank00000.pt", size=512)
    before = sorted(p.name for p in checkpoints.iterdir())

    # Without verification the damaged newest checkpoint is resumed from: its NaN weights stop the run at once.
    result = run(
        launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=42", "checkpoint.verify=false")),
        check=False,
    )
    text = tail(result, 400)
    assert result.returncode != 0
    assert "checkpoint.verify=false: resuming from" in text
    _one_error(text, "the training loss is nan at step 41, the first step after resuming from")
    assert sorted(p.name for p in checkpoints.iterdir()) == before and latest(output) == "step00000040"

    # With verification: three damaged checkpoints skipped, each with its reasons, and the run resumes from
    # step 10. With keep_last=2, saving step 12 must not count the damaged ones and delete step 10.
    result = run(
        torchrun_command(
            TRAIN, args(ptb_word_shards, output, "train.max_steps=12", "checkpoint.every=2", "checkpoint.keep_last=2")
        )
    )
    log = result.stderr
    assert "step00000040/mp_rank_00_model_states.pt: CRC-32" in log and "(damaged)" in log
    assert "step00000030/txl_rank_states/rank00001.pt: " in log and "(truncated or replaced)" in log
    skipped_20 = next(line for line in log.splitlines() if "skipping checkpoint" in line and "step00000020," in line)
    assert "mp_rank_00_model_states.pt" in skipped_20 and "rank00000.pt: CRC-32" in skipped_20
    assert "at step 10 (exact" in log
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step")) == [
        "step00000010",
        "step00000012",
        "step00000020",
        "step00000030",
        "step00000040",
    ]
    straight, resumed = records(reference), records(output)
    for step in (11, 12):
        assert resumed[step]["loss"] == straight[step]["loss"], step


def test_no_orphaned_ranks_one_run_per_directory_and_stale_locks(reference, ptb_word_shards, tmp_path):
    import psutil

    output = tmp_path / "owned"
    # SIGTERM to the deepspeed runner alone: it dies, its launch process lives on, and the ranks notice, write a
    # checkpoint at the current step and exit.
    first = start(launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=400")))
    wait_for_step(output, 3, first, timeout=300)
    ranks = rank_processes(first)
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=30)
    gone, alive = psutil.wait_procs(ranks, timeout=60)
    assert not alive, alive
    out = first.stdout.read()
    assert "the deepspeed runner (PID" in out and "stopping with a checkpoint" in out, out[-3000:]
    stopped_at = max(records(output))
    assert latest(output) == f"step{stopped_at:08d}" and stopped_at < STEPS - 4, stopped_at
    assert not (output / "run.lock").exists()

    # While a run holds the directory, a second one is refused at once, naming the holder.
    with open(tmp_path / "third.log", "w") as third_log:
        third = subprocess.Popen(
            launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=100000", "checkpoint.keep_last=2")),
            cwd=REPO,
            env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"},
            stdout=third_log,
            stderr=subprocess.STDOUT,
        )
    wait_for_step(output, stopped_at + 1, third, timeout=300)
    holder = json.loads((output / "run.lock").read_text())
    second = run(launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=400")), check=False)
    assert second.returncode != 0
    _one_error(tail(second, 200), f"is in use by another run (host {holder['host']}, PID {holder['pid']}, started")
    assert third.poll() is None

    # kill -9 of that whole run leaves its lock behind; the next run takes it over (the PID is dead) and resumes.
    for process in [psutil.Process(third.pid), *psutil.Process(third.pid).children(recursive=True)]:
        process.kill()
    third.wait(timeout=30)
    assert json.loads((output / "run.lock").read_text())["token"] == holder["token"]
    resume_step = int(latest(output).removeprefix("step"))
    result = run(torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={resume_step + 2}")))
    assert (
        f"taking over {output / 'run.lock'} from a run that is gone (host {holder['host']}, PID "
        f"{holder['pid']}, started {holder['started']}): PID {holder['pid']} is no longer running"
    ) in result.stderr
    assert f"at step {resume_step} (exact" in result.stderr
    assert not (output / "run.lock").exists()
    # The resume after the SIGTERM was exact: the first 40 steps equal the uninterrupted reference run's.
    straight, resumed = records(reference), records(output)
    for step in range(1, STEPS + 1):
        assert resumed[step]["loss"] == straight[step]["loss"], step


def test_nodes_that_see_different_output_directories_are_refused(ptb_word_shards, tmp_path):
    """Two "nodes" on localhost started from different working directories, with a relative train.output_dir:
    each sees its own folder, as nodes with local disks would. (With an absolute, shared directory the same
    start runs: test_two_nodes_of_one_process_on_localhost.)"""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(free_port())
    node_args = args(ptb_word_shards, Path("run"), "train.max_steps=6")
    node_args[1] = str(REPO / node_args[1])  # the config; the output directory stays relative
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    nodes = []
    for rank in (0, 1):
        cwd = tmp_path / f"node{rank}"
        cwd.mkdir()
        command = launcher_command(
            str(REPO / TRAIN),
            node_args,
            launcher_flags=[
                "--hostfile",
                str(hostfile),
                "--no_ssh",
                "--node_rank",
                str(rank),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
            ],
        )
        nodes.append(
            subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [finish(node, timeout=180) for node in nodes]
    assert all(node.returncode != 0 for node in nodes)
    _one_error(outs[0] + outs[1], "train.output_dir must be on a filesystem shared by all nodes: rank 1 on")
    # Rank 1 finds the problem and every rank raises it; whichever reports first prints it, in its node's output.
    both = outs[0] + outs[1]
    assert f"rank 1 on {socket.gethostname()} finds no run.lock in {tmp_path / 'node1' / 'run'}" in both
    assert f"wrote this run's in {tmp_path / 'node0' / 'run'}" in both
    assert not (tmp_path / "node1" / "run" / "checkpoints").exists()


class _Crafted:
    """What an attacker would put in a checkpoint: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_pickle_in_a_checkpoint_is_never_run(reference, ptb_word_shards, tmp_path):
    from txl_dist.fileio import file_checksum

    output = tmp_path / "crafted"
    shutil.copytree(reference, output)
    tag_dir = output / "checkpoints" / "step00000040"
    optim = tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    marker = tmp_path / "PWNED"
    state = torch.load(optim, weights_only=False)  # our own file, written by the reference run
    state["optimizer_state_dict"]["payload"] = _Crafted(marker)
    torch.save(state, optim)
    # The attacker also fixes COMPLETE.json, so that the file verifies: the unpickler is what must refuse it.
    complete = json.loads((tag_dir / "COMPLETE.json").read_text())
    complete["files"][optim.name] = file_checksum(optim).to_json()
    (tag_dir / "COMPLETE.json").write_text(json.dumps(complete))

    refused = "refused to unpickle: it refers to posix.system"
    for command in (
        ["launchers/evaluate.py", str(output), "--split", "valid", "--no-progress"],
        ["launchers/convert.py", "zero-to-export", str(output), str(tmp_path / "export")],
    ):
        result = in_process(*command, check=False)
        assert result.returncode == 2 and refused in result.stderr, tail(result)
        assert not marker.exists() and not (tmp_path / "export").exists()
    result = run(launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=42")), check=False)
    assert result.returncode != 0
    _one_error(tail(result, 300), refused)
    assert not marker.exists()


def test_inf_in_mems_is_reset_and_never_saved(ptb_word_shards, tmp_path):
    """tests/scripts/train_with_inf_mems.py makes rank 0's first stream's new memory inf from step 3 on, as an
    overflowing fp16 forward would."""
    output = tmp_path / "inf"
    run(
        torchrun_command(
            "tests/scripts/train_with_inf_mems.py",
            args(ptb_word_shards, output, "train.max_steps=6", "checkpoint.every=0"),
        )
    )
    logged = records(output)
    assert [logged[s]["mems_reset"] for s in (1, 2)] == [0, 0]
    assert [logged[s]["mems_reset"] for s in (3, 6)] == [1, 4]  # one per poisoned micro-batch
    assert all(torch.isfinite(torch.tensor(logged[s]["loss"])) for s in logged)
    states = output / "checkpoints" / latest(output) / "txl_rank_states"
    rank0 = torch.load(states / "rank00000.pt", weights_only=True)
    rank1 = torch.load(states / "rank00001.pt", weights_only=True)
    assert all(torch.isfinite(layer).all() for layer in rank0["mems"] + rank1["mems"])
    assert all((layer[:, 0] == 0).all() and (layer[:, 1] != 0).any() for layer in rank0["mems"])
    assert all((layer != 0).any(dim=(0, 2)).all() for layer in rank1["mems"])


def _stop_during_a_background_save(output: Path, process: subprocess.Popen, last_step: int) -> int:
    """Stops every rank (SIGSTOP) at a moment when a checkpoint folder exists without its COMPLETE.json, which a
    background save leaves from its copy until every rank's write has ended and the ranks agreed on it (at least
    one step), then kills them (SIGKILL); returns that checkpoint's step. Saves that complete before the stop
    lands are let go (SIGCONT) until one does not, at most up to LAST_STEP."""
    checkpoints = output / "checkpoints"
    while process.poll() is None:
        unfinished = sorted(
            path for path in checkpoints.glob("step*") if path.is_dir() and not (path / "COMPLETE.json").exists()
        )
        if unfinished:
            ranks = rank_processes(process)
            for rank in ranks:
                rank.suspend()
            if not (unfinished[-1] / "COMPLETE.json").exists():
                for rank in ranks:
                    rank.kill()
                return int(unfinished[-1].name.removeprefix("step"))
            for rank in ranks:
                rank.resume()
        logged = records(output)
        assert not logged or max(logged) <= last_step, "no stop landed during a background save"
        time.sleep(0.005)
    pytest.fail(f"the run ended (status {process.returncode}) before a stop landed during a background save")


def test_a_kill_during_a_background_save_resumes_from_the_one_before_and_matches_the_uninterrupted_run(
    reference, ptb_word_shards, tmp_path
):
    """checkpoint.background=true: training goes on while a thread writes the checkpoint, and the checkpoint is
    complete only once every rank's write has ended. A kill -9 of every rank while one is in flight leaves the
    previous checkpoint the newest verified one; the same command resumes from it (the unfinished folder is
    removed) and trains on with exactly the losses and data of the uninterrupted run, whose saves were
    synchronous."""
    from txl_dist.checkpoints.verify import verify_checkpoint

    output = tmp_path / "background"
    extra = ("checkpoint.every=5", "checkpoint.background=true")
    command = launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=400", *extra))
    process = start(command)
    wait_for_step(output, 8, process)
    killed_at = _stop_during_a_background_save(output, process, last_step=STEPS - 5)
    finish(process)
    assert process.returncode != 0
    previous = killed_at - 5
    assert latest(output) == f"step{previous:08d}", latest(output)
    result = run(torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={STEPS}", *extra)))
    assert f"removing {output / 'checkpoints' / f'step{killed_at:08d}'}: an interrupted save" in result.stderr
    assert f"at step {previous} (exact" in result.stderr, result.stderr[-3000:]
    assert "writing it in the background" in result.stderr and "complete at step" in result.stderr
    straight, resumed = records(reference), records(output)
    for step in range(previous + 1, STEPS + 1):
        assert resumed[step]["loss"] == straight[step]["loss"], step
        assert resumed[step]["data_checksum"] == straight[step]["data_checksum"], step
    assert latest(output) == f"step{STEPS:08d}"
    assert verify_checkpoint(output / "checkpoints" / latest(output)) == []


def test_a_memory_snapshot_bounds_the_work_that_a_killed_rank_costs(reference, ptb_word_shards, tmp_path):
    """checkpoint.memory_every=3 beside checkpoints every 20 steps: rank 1 is killed (kill -9) some steps after
    the checkpoint of step 20; the same command writes the newest snapshot that both ranks left in the node's
    memory back as a checkpoint and resumes from it, so at most 3 steps (and the one in flight) are recomputed,
    not all since step 20, with exactly the uninterrupted run's losses and data. A clean end removes the
    snapshots from memory."""
    output, memory = tmp_path / "snapshots", tmp_path / "memory"
    extra = ("checkpoint.every=20", "checkpoint.memory_every=3", f"checkpoint.memory_dir={memory}")
    process = start(launcher_command(TRAIN, args(ptb_word_shards, output, "train.max_steps=400", *extra)))
    wait_for_step(output, 26, process)
    rank_processes(process)[1].kill()
    finish(process)
    lost_at = max(records(output))
    assert lost_at < STEPS - 3, lost_at
    result = run(torchrun_command(TRAIN, args(ptb_word_shards, output, f"train.max_steps={STEPS}", *extra)))
    restored = re.search(r"restored step (\d+) from the memory snapshots of 2 rank\(s\)", result.stderr)
    assert restored, result.stderr[-3000:]
    step = int(restored.group(1))
    assert step % 3 == 0 and 20 < step and lost_at - step <= 3 + 1, (step, lost_at)
    assert f"resumed from {output / 'checkpoints' / f'step{step:08d}'} at step {step} (exact" in result.stderr
    straight, resumed = records(reference), records(output)
    for later in range(step + 1, STEPS + 1):
        assert resumed[later]["loss"] == straight[later]["loss"], later
        assert resumed[later]["data_checksum"] == straight[later]["data_checksum"], later
    assert [path for path in memory.rglob("*")] == []
