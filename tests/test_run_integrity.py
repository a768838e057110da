"""Run integrity without the launcher: checkpoint verification, the run lock, weights-only loading, the memory
guard, outputs that never destroy an input, and write failures on real full and read-only filesystems.
(The launcher-level cases are at the end of tests/test_train_launcher.py.)"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

from txl_dist import fileio, output_folders
from txl_dist.checkpoint_paths import COMPLETE
from txl_dist.checkpoints import weights_only
from txl_dist.checkpoints.verify import preflight, verify_checkpoint
from txl_dist.supervision.lock import LOCK_NAME, LockHolder, RunDirectoryBusy, RunLock, read_holder

pytestmark = pytest.mark.launcher

REPO = Path(__file__).resolve().parents[1]


# ---- checkpoint verification -------------------------------------------------------------------------------------


def _checkpoint(directory: Path) -> Path:
    """A checkpoint folder as CheckpointManager.save writes it: files written with their checksums recorded."""
    tag_dir = directory / "step00000005"
    (tag_dir / "txl_rank_states").mkdir(parents=True)
    files = {}
    for name, tensor in (
        ("mp_rank_00_model_states.pt", torch.randn(4096)),
        ("txl_rank_states/rank00000.pt", torch.randn(512)),
    ):
        files[name] = fileio.atomic_write_checksummed(tag_dir / name, lambda h, t=tensor: torch.save({"x": t}, h))
    marker = {"step": 5, "checksum": fileio.CHECKSUM_NAME, "files": {k: v.to_json() for k, v in files.items()}}
    (tag_dir / COMPLETE).write_text(json.dumps(marker))
    return tag_dir


def test_only_the_shared_memory_buffers_of_this_sessions_runs_are_removed(tmp_path):
    """What the autouse fixture of conftest.py runs after each test: DeepSpeed's buffers named by a master port
    this session handed out go; another session's (another port, or a port that only ends in the same digits)
    stay, since removing a live one hangs that session's ranks."""
    from tests.launcher import PORTS_USED, free_port, remove_shm_buffers

    port = free_port()
    ours = {f"deepspeed_allreduce_buffer_0_127.0.0.1_{port}_{rank}" for rank in (0, 1)}
    theirs = {
        f"deepspeed_allreduce_buffer_0_127.0.0.1_{port + 1}_0",
        f"deepspeed_allreduce_buffer_0_127.0.0.1_1{port}_0",
        f"deepspeed_allreduce_buffer_0_10.0.0.2_{port}0_1",
    }
    for name in ours | theirs:
        (tmp_path / name).write_bytes(b"")
    assert sorted(path.name for path in remove_shm_buffers(tmp_path)) == sorted(ours)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(theirs)
    assert not PORTS_USED


def test_checksums_computed_while_writing_equal_a_read_back(tmp_path):
    data = os.urandom(3 * 2**20 + 17)
    written = fileio.atomic_write_checksummed(tmp_path / "f", lambda handle: handle.write(data))
    import zlib

    assert written == fileio.file_checksum(tmp_path / "f") == fileio.FileChecksum(len(data), f"{zlib.crc32(data):08x}")


def test_verification_names_every_damaged_missing_and_unlisted_file(tmp_path):
    tag_dir = _checkpoint(tmp_path)
    assert verify_checkpoint(tag_dir) == []
    model = tag_dir / "mp_rank_00_model_states.pt"
    with open(model, "r+b") as handle:  # same size, other bytes
        handle.seek(model.stat().st_size // 2)
        handle.write(b"\xff" * 64)
    os.truncate(tag_dir / "txl_rank_states/rank00000.pt", 100)
    (tag_dir / "zero_pp_rank_9_mp_rank_00_optim_states.pt").write_bytes(b"planted")
    problems = verify_checkpoint(tag_dir)
    assert len(problems) == 3, problems
    assert any(p.startswith(f"{model}: CRC-32") and p.endswith("(damaged)") for p in problems)
    assert any("rank00000.pt: 100 bytes, COMPLETE.json records" in p for p in problems)
    assert any("zero_pp_rank_9_mp_rank_00_optim_states.pt: not listed in COMPLETE.json" in p for p in problems)
    model.unlink()
    assert f"{model}: missing" in verify_checkpoint(tag_dir)
    marker = json.loads((tag_dir / COMPLETE).read_text())
    del marker["files"]
    (tag_dir / COMPLETE).write_text(json.dumps(marker))
    assert "lists no file checksums" in verify_checkpoint(tag_dir)[0]


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.bin", "txl_rank_states/../../outside.bin"])
def test_verification_refuses_a_listed_name_outside_the_checkpoint(tmp_path, name):
    tag_dir = _checkpoint(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not a checkpoint file")
    marker = json.loads((tag_dir / COMPLETE).read_text())
    # The size and CRC of the real file, so that only the name can give it away.
    size, crc = outside.stat().st_size, f"{zlib.crc32(outside.read_bytes()):08x}"
    if name.startswith("/"):
        data = Path(name).read_bytes()
        size, crc = len(data), f"{zlib.crc32(data):08x}"
    entry = next(iter(marker["files"].values()))
    marker["files"][name] = {**entry, "bytes": size, "crc32": crc}
    (tag_dir / COMPLETE).write_text(json.dumps(marker))
    problems = verify_checkpoint(tag_dir)
    assert f"{tag_dir / COMPLETE}: lists {name!r}, which is not a file inside {tag_dir}" in problems, problems


def test_the_start_rules_refuse_a_fresh_start_and_another_architecture_and_leave_a_damaged_marker(tmp_path):
    """`preflight` (the command line, before any process group) applies `refuse_to_start` to the newest complete
    checkpoint: a fresh start beside it and another architecture are refused by name; a damaged marker passes (the
    trainer's verification then names it); an empty directory passes either way."""
    tag_dir = _checkpoint(tmp_path)
    marker = json.loads((tag_dir / COMPLETE).read_text())
    (tag_dir / COMPLETE).write_text(json.dumps({**marker, "architecture": {"d_model": 16, "n_layer": 2}}))
    preflight(tmp_path, resume=True, architecture={"d_model": 16, "n_layer": 2})
    with pytest.raises(ValueError, match=r"was trained with another architecture: d_model: checkpoint 16, config 32$"):
        preflight(tmp_path, resume=True, architecture={"d_model": 32, "n_layer": 2})
    with pytest.raises(ValueError, match=rf"holds checkpoints \(newest {tag_dir.name}\)"):
        preflight(tmp_path, resume=False, architecture={"d_model": 16, "n_layer": 2})
    (tag_dir / COMPLETE).write_text("{not json")
    preflight(tmp_path, resume=True, architecture={"d_model": 32, "n_layer": 2})
    preflight(tmp_path / "nothing", resume=False, architecture={})


def _tag_with_its_universal_conversion(directory: Path, step: int) -> tuple[Path, Path]:
    """A complete checkpoint of ``step`` and a universal folder of it (as ``ds_to_universal`` lays one out)."""
    tag_dir = _checkpoint(directory)
    tag_dir = tag_dir.rename(directory / f"step{step:08d}")
    universal = directory / f"{tag_dir.name}_universal"
    (universal / "zero" / "embedding.weight").mkdir(parents=True)
    torch.save({"param": torch.zeros(4)}, universal / "zero" / "embedding.weight" / "fp32.pt")
    return tag_dir, universal


def test_the_start_removes_what_a_stopped_run_left_unfinished_and_names_the_rest(tmp_path, caplog):
    """A conversion killed on its way (or one that failed before this fix) leaves a universal folder, or its
    staging folder, that no reader trusts and nothing else removes; a killed atomic write leaves its temporary.
    Rank 0 removes them at start (the lock held); a file that no part of a run writes is named and kept."""
    from txl_dist.checkpoints.manager import CheckpointManager

    tag_dir, universal = _tag_with_its_universal_conversion(tmp_path, 20)
    staging = tmp_path / ".step00000020_universal.0123456789abcdef.tmp"
    (staging / "zero").mkdir(parents=True)
    (tmp_path / ".latest.fedcba9876543210.tmp").write_text("step0000")
    (tmp_path / "latest_universal").write_text(staging.name)
    (tmp_path / "step00000030" / "txl_rank_states").mkdir(parents=True)  # a save that was interrupted
    (tmp_path / "latest").write_text(tag_dir.name + "\n")
    (tmp_path / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
    (tmp_path / "notes.txt").write_text("the user's\n")
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=1).remove_unfinished()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "notes.txt", tag_dir.name, "zero_to_fp32.py"]
    removed = [record.getMessage() for record in caplog.records if record.getMessage().startswith("removing")]
    assert len(removed) == 5 and any(f"removing {universal}: a universal conversion" in line for line in removed)
    assert f"{tmp_path / 'notes.txt'} was not written by txl_dist's checkpointing: left as it is" in caplog.text


def test_rotation_removes_the_universal_folder_of_a_checkpoint_it_rotates_away(tmp_path):
    from txl_dist.checkpoints.manager import CheckpointManager

    old, old_universal = _tag_with_its_universal_conversion(tmp_path, 10)
    new, new_universal = _tag_with_its_universal_conversion(tmp_path, 20)
    manager = CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=1)
    manager.newest_verified = new.name
    manager._prune(keep={new.name})
    assert sorted(path.name for path in tmp_path.iterdir()) == [new.name, new_universal.name]


# ---- weights-only loading ----------------------------------------------------------------------------------------


class _Crafted:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_deepspeed_classes_load_and_a_crafted_pickle_is_refused_unrun(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(
        init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    torch.save({"loss_scaler": scaler, "zero_stage": ZeroStageEnum(2), "w": torch.ones(3)}, tmp_path / "ok.pt")
    loaded = weights_only.load(tmp_path / "ok.pt")
    assert loaded["loss_scaler"].cur_scale == 2**16 and loaded["zero_stage"] == ZeroStageEnum(2)

    marker = tmp_path / "PWNED"
    torch.save({"w": torch.ones(3), "x": _Crafted(marker)}, tmp_path / "bad.pt")
    with pytest.raises(
        weights_only.UnsafeCheckpointError,
        match=r"bad.pt: refused to unpickle: it refers to "
        r"posix.system",
    ):
        weights_only.load(tmp_path / "bad.pt")
    # What DeepSpeed's own code calls, inside the guard: torch.load(..., weights_only=False).
    with weights_only.deepspeed_loads_weights_only(), pytest.raises(weights_only.UnsafeCheckpointError):
        torch.load(tmp_path / "bad.pt", map_location="cpu", weights_only=False)
    assert torch.load is weights_only._ORIGINAL_LOAD
    assert not marker.exists()


# ---- the run lock ------------------------------------------------------------------------------------------------


def test_a_second_run_is_refused_naming_the_holder_until_the_lock_is_released(tmp_path):
    first = RunLock(tmp_path / "run").acquire()
    holder = read_holder(tmp_path / "run" / LOCK_NAME)
    assert (holder.host, holder.pid, holder.token) == (socket.gethostname(), os.getpid(), first.token)
    with pytest.raises(
        RunDirectoryBusy,
        match=re.escape(
            f"is in use by another run (host {socket.gethostname()}, PID {os.getpid()}, started {holder.started}; lock"
        ),
    ):
        RunLock(tmp_path / "run").acquire()
    first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    second = RunLock(tmp_path / "run").acquire()
    first.release()  # not its lock any more: nothing happens
    assert read_holder(tmp_path / "run" / LOCK_NAME).token == second.token
    second.release()


def _write_holder(directory: Path, **fields) -> LockHolder:
    holder = LockHolder.of_this_process()
    for key, value in fields.items():
        setattr(holder, key, value)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_NAME).write_text(json.dumps(holder.__dict__))
    return holder


def test_locks_of_dead_or_recycled_processes_are_taken_over(tmp_path, caplog):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    _write_holder(tmp_path, pid=finished.pid)
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        RunLock(tmp_path).acquire().release()
        _write_holder(tmp_path, pid_start=1)  # this PID, but not the process that took the lock
        RunLock(tmp_path).acquire().release()
        _write_holder(tmp_path, boot_id="another-boot")
        RunLock(tmp_path).acquire().release()
    reasons = [r.getMessage().rsplit(": ", 1)[1] for r in caplog.records if "taking over" in r.getMessage()]
    assert reasons == [
        f"PID {finished.pid} is no longer running",
        f"PID {os.getpid()} is another process now",
        "the host has restarted since",
    ]


def test_a_lock_on_another_host_is_alive_while_its_heartbeat_moves(tmp_path, caplog):
    holder = _write_holder(tmp_path, host="node-elsewhere")
    beating = threading.Event()

    def beat() -> None:
        while not beating.wait(0.1):
            holder.heartbeat += 1
            fileio.atomic_write_text(tmp_path / LOCK_NAME, json.dumps(holder.__dict__))

    thread = threading.Thread(target=beat)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(RunDirectoryBusy, match="host node-elsewhere"):
            RunLock(tmp_path, heartbeat_s=0.1, stale_after_s=5).acquire()
    finally:
        beating.set()
        thread.join()
    assert time.monotonic() - started < 2
    # Node loss: the heartbeat stops; after stale_after_s the lock is taken over.
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        lock = RunLock(tmp_path, heartbeat_s=0.1, stale_after_s=0.5).acquire()
    assert "its heartbeat has not moved for 0 s" in caplog.text or "has not moved for 1 s" in caplog.text
    # The holder's own heartbeat moves, and losing the lock is reported.
    lost = []
    lock.on_lost = lost.append
    first = read_holder(tmp_path / LOCK_NAME).heartbeat
    time.sleep(0.35)
    assert read_holder(tmp_path / LOCK_NAME).heartbeat > first
    (tmp_path / LOCK_NAME).unlink()
    time.sleep(0.35)
    assert lost == [f"lost the run lock {tmp_path / LOCK_NAME}: the file was removed"]
    lock.release()


# ---- the memory guard --------------------------------------------------------------------------------------------


def test_non_finite_mems_are_reset_per_stream_and_counted():
    from txl_dist.training.train_state import finite_mems as _finite_mems

    mems = [torch.randn(4, 3, 5) for _ in range(3)]
    mems[1][2, 1, 3] = float("inf")
    mems[2][0, 2, 0] = float("nan")
    resets = torch.zeros((), dtype=torch.int64)
    guarded = _finite_mems(mems, resets)
    assert resets.item() == 2
    for before, after in zip(mems, guarded):
        assert torch.equal(after[:, 0], before[:, 0])
        assert (after[:, 1:] == 0).all()
    assert _finite_mems([torch.empty(0, 3, 5)], resets)[0].shape == (0, 3, 5) and resets.item() == 2


# ---- outputs that never destroy an input -------------------------------------------------------------------------


def _tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        digest.update(str(path.relative_to(directory)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset

    model = TransformerXLLM(preset("tiny", n_token=700))
    return write_export(model, model.config, tmp_path_factory.mktemp("exports") / "export")


def _convert(*args: str) -> subprocess.CompletedProcess:
    from tests.launcher import in_process

    return in_process("launchers/convert.py", *args, check=False)


def test_export_to_hf_into_itself_or_its_parent_is_refused_and_the_input_kept(export_dir, tmp_path):
    before = _tree_digest(export_dir.parent)
    for output, what in ((export_dir, "is the input"), (export_dir.parent, "contains the input")):
        result = _convert("export-to-hf", str(export_dir), str(output), "--overwrite")
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr == f"convert.py export-to-hf: error: output {output} {what} {export_dir}: " + (
            "choose another output\n"
            if what == "is the input"
            else "replacing it would delete the input; choose another output\n"
        )
    assert _tree_digest(export_dir.parent) == before


def test_overwrite_replaces_only_what_txl_dist_wrote(export_dir, tmp_path):
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "todo.txt").write_text("keep me")
    with pytest.raises(output_folders.OutputPathError, match="holds files this tool did not write"):
        output_folders.check_output_path(unrelated, [export_dir], overwrite=True)
    with pytest.raises(output_folders.OutputPathError, match="lies inside the input"):
        output_folders.check_output_path(export_dir / "hf", [export_dir], overwrite=True)
    (tmp_path / "link").symlink_to(export_dir)
    with pytest.raises(output_folders.OutputPathError, match="is the input"):
        output_folders.check_output_path(tmp_path / "link", [export_dir], overwrite=True)
    (tmp_path / "empty").mkdir()
    assert output_folders.check_output_path(tmp_path / "empty", [export_dir], overwrite=True) == tmp_path / "empty"
    # Ours: marked.
    assert output_folders.check_output_path(export_dir, [tmp_path / "empty"], overwrite=True) == export_dir


# ---- write failures on real full and read-only filesystems -------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MB tmpfs (needs root; skipped elsewhere), remounted read-only by the tests that want that."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.decode().strip() or 'not root'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _read_only(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)


def test_a_full_disk_stops_build_shards_and_convert_with_one_line_and_nothing_partial(
    small_tmpfs, ptb_word_tokenizer, export_dir, capsys
):
    from data_tools import build_shards

    output = small_tmpfs / "shards"
    status = build_shards.main(
        [
            "--tokenizer",
            str(ptb_word_tokenizer),
            "--output",
            str(output),
            "--format",
            "ptb",
            "--tokens-per-block",
            "4096",
            "--tokens-per-shard",
            "131072",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert status == 1
    assert len(err.splitlines()) == 1 and err.startswith(f"build_shards: error: {output}/")
    assert err.rstrip().endswith(".tar: no space left on device"), err
    left = sorted(p.name for p in output.iterdir())
    assert "manifest.json" not in left and not [name for name in left if "partial" in name or ".tmp" in name], left
    # The same disk, filled to the last byte, under a conversion.
    from launchers import convert

    with open(small_tmpfs / "filler", "wb", buffering=0) as filler:
        try:
            while filler.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    assert convert.main(["export-to-hf", str(export_dir), str(small_tmpfs / "hf")]) == 1  # a failure, not input
    assert capsys.readouterr().err == f"convert.py export-to-hf: error: {small_tmpfs / 'hf'}: no space left on device\n"
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler", "shards"]


def test_read_only_outputs_fail_with_one_line(small_tmpfs, export_dir, ptb_word_tokenizer, tmp_path, capsys):
    from data_tools import train_tokenizer

    _read_only(small_tmpfs)
    status = train_tokenizer.main(
        ["--kind", "word", "--format", "ptb", "--output", str(small_tmpfs / "tok"), "--no-progress"]
    )
    assert status == 1
    assert capsys.readouterr().err == f"train_tokenizer: error: {small_tmpfs / 'tok'}: read-only file system\n"
    from launchers import convert

    assert convert.main(["export-to-hf", str(export_dir), str(small_tmpfs / "hf")]) == 1  # a failure, not input
    out = capsys.readouterr()
    assert out.err == f"convert.py export-to-hf: error: {small_tmpfs / 'hf'}: read-only file system\n"
    assert list(small_tmpfs.iterdir()) == []


# ---- empty input and damaged shards ------------------------------------------------------------------------------


def test_empty_input_is_an_error_unless_asked_for(ptb_word_tokenizer, tmp_path, capsys):
    from data_tools import build_shards, train_tokenizer

    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--input", str(empty), "--output", str(tmp_path / "tok"), "--no-progress"]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert "train_tokenizer: error: no document in the input" in error and f"{empty} (1 files" in error
    assert not (tmp_path / "tok" / "tokenizer.json").exists()
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "word",
                "--input",
                str(empty),
                "--output",
                str(tmp_path / "tok"),
                "--no-progress",
                "--allow-empty",
                "--overwrite",
            ]
        )
        == 0
    )
    shards = [
        "--tokenizer",
        str(ptb_word_tokenizer),
        "--output",
        str(tmp_path / "shards"),
        "--split",
        f"train={empty}",
        "--no-progress",
    ]
    assert build_shards.main(shards) == 2
    assert "build_shards: error: split 'train' has no documents" in capsys.readouterr().err
    assert not (tmp_path / "shards" / "manifest.json").exists()
    assert build_shards.main([*shards, "--resume", "--allow-empty"]) == 0
    assert (tmp_path / "shards" / "manifest.json").is_file()


def test_decoding_a_damaged_shard_is_one_line(ptb_word_shards, ptb_word_tokenizer, tmp_path, capsys):
    from data_tools import inspect_shards

    shards = tmp_path / "shards"
    shutil.copytree(ptb_word_shards, shards)
    os.truncate(shards / "train-000000.tar", 700)
    # Refused input, 2 (docs/architecture.md, Rules); problems that --verify finds are its verdict, 3.
    assert inspect_shards.main([str(shards), "--decode", "2", "--tokenizer", str(ptb_word_tokenizer)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"inspect_shards: error: {shards / 'train-000000.tar'}: truncated or damaged shard (unexpected "
        f"end of data); --verify checks every shard\n"
    )


# ---- no orphaned ranks: what a rank watches ----------------------------------------------------------------------

_RANK = """
import os, sys, time
from txl_dist.supervision.guard import RunGuard
guard = RunGuard(install_signals=False)
print("ready", flush=True)
deadline = time.monotonic() + 30
while guard.reason is None and time.monotonic() < deadline:
    time.sleep(0.05)
# Written whole, then renamed: the test reads the file as soon as it exists.
with open(sys.argv[1] + ".partial", "w") as out:
    out.write(str(guard.reason))
os.replace(sys.argv[1] + ".partial", sys.argv[1])
"""
# Stands in for DeepSpeed's per-node launcher: its command line names it, as the ranks look for.
_LAUNCH = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])"


@pytest.mark.parametrize("gone", ["reader", "launcher"])
def test_a_rank_asks_to_stop_when_its_launcher_or_the_reader_of_its_output_is_gone(gone, tmp_path):
    """The SIGTERM-to-the-runner case runs for real in test_train_launcher.py; these are the other two ways a
    rank learns that its job is gone: its parent (launch) dies, or its output pipe loses its reader (an ssh
    connection of pdsh)."""
    import signal

    reason_file = tmp_path / "reason"
    launch = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, _RANK, str(reason_file), "deepspeed.launcher.launch"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert launch.stdout.readline() == b"ready\n"
    if gone == "reader":
        launch.stdout.close()
    else:
        launch.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not reason_file.exists():
        assert time.monotonic() < deadline, "the rank did not notice"
        time.sleep(0.05)
    reason = reason_file.read_text()
    launch.wait(timeout=20)
    if gone == "reader":
        assert reason == "the reader of its output (the launcher or its ssh connection) is gone"
    else:
        assert reason == f"DeepSpeed's per-node launcher (PID {launch.pid}) exited"


def test_a_full_disk_during_a_checkpoint_stops_every_rank_with_one_line(small_tmpfs, ptb_word_shards):
    """Training into a 2 MB filesystem: the second checkpoint does not fit. One rank's write fails; every rank
    stops, the message is printed once (no traceback, no gloo error), the half-written checkpoint is removed, the
    complete one and the lock's release are what is left."""
    from tests.launcher import launcher_command, run, tail

    output = small_tmpfs / "run"
    result = run(
        launcher_command(
            "launchers/train.py",
            [
                "--config",
                "configs/tiny_cpu.yaml",
                f"data.shards={ptb_word_shards}",
                f"train.output_dir={output}",
                "train.max_steps=8",
                "eval.every=0",
                "log.every=1",
                "checkpoint.every=2",
                "checkpoint.keep_last=0",
            ],
        ),
        check=False,
    )
    text = tail(result, 300)
    assert result.returncode != 0
    errors = [line for line in text.splitlines() if line.startswith("train.py: error")]
    assert len(errors) == 1 and errors[0].endswith(": no space left on device"), text[-3000:]
    assert f"{output}/checkpoints/step000000" in errors[0]
    assert "Traceback" not in text and "Connection closed" not in text
    steps = sorted(p.name for p in (output / "checkpoints").iterdir() if p.name.startswith("step"))
    assert steps and all((output / "checkpoints" / tag / "COMPLETE.json").is_file() for tag in steps), steps
    assert not (output / "run.lock").exists()


def _files_bytes(folder: Path) -> int:
    """What ``folder``'s files take on a tmpfs: whole 4 KiB pages."""
    return sum(-(-path.stat().st_size // 4096) * 4096 for path in folder.rglob("*") if path.is_file())


def test_a_full_disk_during_the_universal_conversion_fails_with_one_line_and_leaves_nothing(ptb_word_shards, tmp_path):
    """A ZeRO-2 checkpoint resumed at ZeRO-3 is converted through DeepSpeed's ``ds_to_universal``, which saves
    by path: on a full disk torch's writer raised "unexpected pos 704 vs 598" (a traceback, then that line,
    naming neither the file nor the cause) and the half-written ``step00000002_universal`` stayed. Now the one
    line names the folder and the cause, nothing of the conversion is left, and once there is room the same
    command converts and trains."""
    from tests.launcher import run, tail

    def train(output: Path, stage: int, steps: int, check: bool = True):
        args = [f"data.shards={ptb_word_shards}", f"train.output_dir={output}", f"zero.stage={stage}"]
        steps_args = [f"train.max_steps={steps}", "schedule.warmup_steps=0", "checkpoint.every=2", "eval.every=0"]
        command = [sys.executable, "launchers/train.py", "--config", "configs/tiny_cpu.yaml", *args, *steps_args]
        return run(command, check=check)

    base = tmp_path / "base"
    train(base, stage=2, steps=2)
    mount = tmp_path / "mnt"
    mount.mkdir()
    # Room for the run folder and the resume's own small files, not for a converted copy of the checkpoint.
    size_kib = (_files_bytes(base) + (256 << 10)) >> 10
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        output = mount / "run"
        shutil.copytree(base, output)
        result = train(output, stage=3, steps=4, check=False)
        text = tail(result, 300)
        errors = [line for line in text.splitlines() if line.startswith("train.py: error")]
        assert result.returncode == 1, text[-3000:]
        assert errors == [f"train.py: error: {output}/checkpoints/step00000002_universal: no space left on device"]
        assert "Traceback" not in text and "unexpected pos" not in text
        left = sorted(path.name for path in (output / "checkpoints").iterdir())
        assert left == ["latest", "step00000002", "zero_to_fp32.py", "zero_to_torch.py"], left
        subprocess.run(["mount", "-o", f"remount,size={4 * size_kib}k", str(mount)], check=True)
        resumed = train(output, stage=3, steps=4)
        assert "into ZeRO stage 3 on 1 ranks, converted by txl_dist" in resumed.stderr
        assert not [path for path in (output / "checkpoints").iterdir() if "universal" in path.name]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_an_output_dir_that_is_a_file_is_refused_before_anything_starts(ptb_word_shards, tmp_path, capsys):
    from txl_dist.training.startup import parse_run_args

    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(SystemExit) as stopped:
        parse_run_args(
            [
                "--config",
                str(REPO / "configs" / "tiny_cpu.yaml"),
                f"data.shards={ptb_word_shards}",
                f"train.output_dir={tmp_path / 'run'}",
            ],
            world_size=2,
            device="cpu",
        )
    assert stopped.value.code == 2
    assert capsys.readouterr().err.endswith(f"train.output_dir='{tmp_path / 'run'}': a file, not a directory\n")


def test_evaluate_and_convert_refuse_a_damaged_checkpoint_and_no_verify_reads_it(ptb_word_shards, tmp_path):
    """The tools agree with resume about a checkpoint. Damaged in place (4 KiB overwritten, same size, as in the
    issue): evaluate.py and zero-to-export refuse it in one line naming the file, and write nothing, where before
    they read its fp32 masters and reported a finite perplexity. A checkpoint whose record alone is wrong (the
    files intact) is read with --no-verify, which says so, and gives the result of an intact one."""
    from tests.launcher import in_process, run, tail

    output = tmp_path / "run"
    run(
        [
            sys.executable,
            "launchers/train.py",
            "--config",
            "configs/tiny_cpu.yaml",
            f"data.shards={ptb_word_shards}",
            f"train.output_dir={output}",
            "train.max_steps=2",
            "schedule.warmup_steps=1",
            "eval.every=0",
            "log.every=1",
            "checkpoint.every=0",
            "train.micro_batch=4",
            "eval.batch_size=64",
            "eval.tgt_len=32",
        ]
    )
    tag_dir = output / "checkpoints" / "step00000002"
    # evaluate.py and convert.py called in this process (one rank, no process group), their output captured.
    evaluate = ["launchers/evaluate.py", str(output), "--split", "valid", "--batch-size", "8", "--no-progress"]
    intact = in_process(*evaluate, "--output", str(tmp_path / "intact.json"))
    assert "warning" not in intact.stderr
    expected_loss = json.loads((tmp_path / "intact.json").read_text())["loss"]

    model_states = tag_dir / "mp_rank_00_model_states.pt"
    original = model_states.read_bytes()
    middle = len(original) // 2
    model_states.write_bytes(original[:middle] + bytes(4096) + original[middle + 4096 :])
    assert model_states.stat().st_size == len(original)
    for name, command in (
        ("evaluate.py", [*evaluate, "--output", str(tmp_path / "damaged.json")]),
        (
            "convert.py zero-to-export",
            ["launchers/convert.py", "zero-to-export", str(output), str(tmp_path / "export")],
        ),
    ):
        result = in_process(*command, check=False)
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode != 0 and len(errors) == 1, tail(result)
        assert errors[0].startswith(f"{name}: error: {tag_dir} fails verification"), errors[0]
        assert f"{model_states}: CRC-32" in errors[0] and "--no-verify" in errors[0], errors[0]
    assert not (tmp_path / "damaged.json").exists() and not (tmp_path / "export").exists()

    # The files intact, the record of one wrong: refused as above unless --no-verify, which warns and reads it.
    model_states.write_bytes(original)
    complete = json.loads((tag_dir / COMPLETE).read_text())
    record = complete["files"][model_states.name]
    record["crc32"] = f"{(int(record['crc32'], 16) ^ 1):08x}"
    (tag_dir / COMPLETE).write_text(json.dumps(complete))
    assert in_process(*evaluate, "--output", str(tmp_path / "refused.json"), check=False).returncode != 0
    unverified = in_process(*evaluate, "--no-verify", "--output", str(tmp_path / "unverified.json"))
    assert "warning: --no-verify" in unverified.stderr
    assert json.loads((tmp_path / "unverified.json").read_text())["loss"] == expected_loss
    converted = in_process(
        "launchers/convert.py", "zero-to-export", str(output), str(tmp_path / "export"), "--no-verify"
    )
    assert "warning: --no-verify" in converted.stderr and (tmp_path / "export" / "config.json").is_file()


@pytest.mark.parametrize(
    "command, inputs",
    [
        ("zero-to-export", ["checkpoint"]),
        ("export-to-hf", ["export"]),
        ("export-to-hub", ["export"]),
        ("hf-to-export", ["hf"]),
        ("export-to-original", ["export"]),
        ("original-to-export", ["original.pt", "config.json"]),
    ],
)
def test_no_conversion_writes_over_its_input_or_a_folder_that_holds_it(command, inputs, tmp_path, capsys):
    """Every subcommand of convert.py, before it reads anything: an output that is its first input, or the folder
    holding it (with --overwrite), is refused in one line, and nothing in the tree changes."""
    from launchers import convert

    home = tmp_path / "inputs"
    paths = []
    for name in inputs:
        path = home / name
        if name.endswith((".pt", ".json")):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
        else:
            path.mkdir(parents=True)
            (path / "weights").write_bytes(b"\0" * 64)
        paths.append(str(path))
    before = _tree_digest(tmp_path)
    for output, what in ((paths[0], "is the input"), (str(home), "contains the input")):
        assert convert.main([command, *paths, output, "--overwrite"]) == 2
        error = capsys.readouterr().err
        assert error == f"convert.py {command}: error: output {output} {what} {paths[0]}: " + (
            "choose another output\n"
            if what == "is the input"
            else "replacing it would delete the input; choose another output\n"
        ), error
    assert _tree_digest(tmp_path) == before
