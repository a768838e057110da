"""Memory snapshots whose own description cannot be trusted (issue 48's campaign, "snap_*", "runid_*", "md_*"): a
snapshot is a recovery path, so a damaged, foreign, misnamed or unwritable one costs only its own protection,
never the run and never another run. A world of one rank (gloo) in this process; the restore writes into a real
checkpoints folder through `CheckpointManager.mark_complete`."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from tests.test_snapshots import manifest_of
from txl_dist.checkpoint_paths import COMPLETE
from txl_dist.checkpoints.manager import CheckpointManager
from txl_dist.checkpoints.record import CheckpointRecord
from txl_dist.checkpoints.snapshot_files import (
    RUN_ID,
    SNAPSHOT,
    crc32,
    name_problem,
    read_run_id,
    run_id_record,
    write_snapshot,
)
from txl_dist.checkpoints.snapshots import Snapshots, run_id
from txl_dist.config import load_config
from txl_dist.config.fields import ConfigError
from txl_dist.rendezvous.ranks import Place
from txl_dist.training.startup import restore_snapshots

RUN = "ab" * 16
FILES = {"mp_rank_00_model_states.pt": b"model" * 50, "txl_rank_states/rank00000.pt": b"rank state"}


@pytest.fixture
def world(tmp_path):
    """A process group of one rank (gloo), left again after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def run(tmp_path) -> SimpleNamespace:
    """A run folder with its id, a checkpoints folder and a memory folder of its own."""
    output = tmp_path / "run"
    (output / "checkpoints").mkdir(parents=True)
    (output / RUN_ID).write_text(run_id_record(RUN, str(output.resolve())))
    memory = tmp_path / "memory"
    root = memory / f"txl_dist-{RUN}"
    return SimpleNamespace(path=output, checkpoints=output / "checkpoints", memory=memory, root=root)


def manifest(run, step: int, rank: int = 0, world_size: int = 1) -> dict:
    """A manifest of this run's snapshot, as `Snapshots.take` writes it (`tests.test_snapshots.manifest_of`)."""
    return manifest_of(FILES, rank, step, RUN, output_dir=str(run.path.resolve()), world_size=world_size)


def take(run, step: int, rank: int = 0, world_size: int = 1) -> Path:
    folder = run.root / f"rank{rank:05d}" / f"step{step:08d}"
    write_snapshot(folder, manifest(run, step, rank, world_size), FILES)
    return folder


def damage(folder: Path, edit) -> None:
    """The manifest of ``folder`` rewritten by ``edit`` (a function of the decoded manifest)."""
    path = folder / SNAPSHOT
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def snapshots(run, taking: bool = True) -> Snapshots:
    return Snapshots(run.memory, RUN, run.path, 0, 1, ["node1"], taking)


def restore(run, newer_than: int = -1) -> int | None:
    manager = CheckpointManager(run.checkpoints, rank=0, world_size=1, keep_last=2)
    return snapshots(run).restore(run.checkpoints, manager.mark_complete, newer_than)


def without(key):
    def edit(manifest: dict) -> dict:
        del manifest[key]
        return manifest

    return edit


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda m: [1], "SNAPSHOT.json is a JSON list, not an object"),
        (lambda m: {**m, "files": list(m["files"])}, "'files' is"),
        (without("world_size"), "has no 'world_size'"),
        (lambda m: {**m, "world_size": "1"}, "'world_size' is '1', not a number of ranks"),
        (lambda m: {**m, "world_size": 0}, "'world_size' is 0, not a number of ranks"),
        (lambda m: {**m, "rank": 3, "world_size": 2}, "is not a rank of its 'world_size' 2"),
        (lambda m: {**m, "step": -1}, "'step' is -1"),
        (lambda m: {**m, "zero_stage": 7}, "'zero_stage' is 7, not a ZeRO stage"),
        (lambda m: {**m, "architecture": "tiny"}, "'architecture' is 'tiny'"),
        (without("output_dir"), "has no 'output_dir'"),
        (lambda m: {**m, "health": [3.5]}, "'health' is [3.5]"),
        (lambda m: {**m, "files": {**m["files"], "x.pt": {"bytes": -1, "crc32": "0"}}}, "entry of 'x.pt'"),
        (lambda m: {**m, "files": {**m["files"], "x.pt": {"bytes": 1, "crc32": "zz"}}}, "entry of 'x.pt'"),
    ],
)
def test_a_damaged_manifest_is_skipped_with_one_warning_and_the_one_before_restored(world, run, edit, named, caplog):
    take(run, 12)
    damage(take(run, 14), edit)
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert restore(run) == 12
    warnings = [r.getMessage() for r in caplog.records if "step00000014 skipped" in r.getMessage()]
    assert len(warnings) == 1 and named in warnings[0], caplog.text
    assert sorted(path.name for path in run.checkpoints.iterdir()) == ["latest", "step00000012"]


@pytest.mark.parametrize("name", ["../../evil2", "/tmp/evil2", "a/../../evil2", "a\\..\\evil", "./x", "a//b", ""])
def test_a_restore_writes_only_inside_its_checkpoint_folder(world, run, name, caplog):
    take(run, 12)
    folder = take(run, 14)
    (run.root / "evil2").write_bytes(b"EVIL\n")
    damage(folder, lambda m: {**m, "files": {**m["files"], name: {"bytes": 5, "crc32": crc32(b"EVIL\n")}}})
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert restore(run) == 12
    assert "step00000014 skipped: SNAPSHOT.json lists the file" in caplog.text
    assert not (run.path / "evil2").exists() and not Path("/tmp/evil2").exists()
    assert sorted(path.name for path in run.checkpoints.iterdir()) == ["latest", "step00000012"]
    assert name_problem(name) is not None


def test_a_snapshot_read_through_a_symbolic_link_is_skipped(world, run, tmp_path, caplog):
    take(run, 12)
    folder = take(run, 14)
    elsewhere = tmp_path / "elsewhere.pt"
    elsewhere.write_bytes(FILES["mp_rank_00_model_states.pt"])
    (folder / "mp_rank_00_model_states.pt").unlink()
    (folder / "mp_rank_00_model_states.pt").symlink_to(elsewhere)  # same bytes, same checksum: still refused
    linked = run.root / "rank00000" / "step00000016"
    linked.symlink_to(take(SimpleNamespace(**{**vars(run), "root": tmp_path / "other"}), 16))
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert restore(run) == 12
    assert "step00000014 skipped" in caplog.text and "symbolic link" in caplog.text
    assert "step00000016 skipped" in caplog.text


def test_a_snapshot_is_compared_with_the_newest_checkpoint_that_verifies(world, run):
    """A restore is asked for snapshots newer than the newest good checkpoint (a damaged newer one does not
    count: `restore_snapshots` asks `CheckpointManager.newest_good_tag`); a tag folder in the way is never
    written over."""
    take(run, 14)
    assert restore(run, newer_than=16) is None
    (run.checkpoints / "step00000014").mkdir()  # a damaged checkpoint of that step
    assert restore(run, newer_than=10) is None
    shutil.rmtree(run.checkpoints / "step00000014")
    assert restore(run, newer_than=10) == 14
    marker = json.loads((run.checkpoints / "step00000014" / COMPLETE).read_text())
    assert marker["step"] == 14 and marker["health"] == {"loss": 3.5, "grad_norm": 0.25}
    assert [path.name for path in run.checkpoints.iterdir() if path.name.startswith(".")] == []


def test_at_start_the_snapshot_newer_than_the_newest_good_checkpoint_wins_over_a_damaged_newer_one(
    world, run, tmp_path
):
    """snap_vs_damaged_ckpt: checkpoint 16 is damaged, so the snapshot of step 14 (newer than the good 10) is
    written back and resumed; before, it was thrown away as "not newer than the newest checkpoint"."""
    for step, body in ((10, b"good"), (16, b"torn")):
        tag = run.checkpoints / f"step{step:08d}"
        tag.mkdir()
        (tag / "weights.pt").write_bytes(body)
        files = {"weights.pt": {"bytes": 4, "crc32": crc32(b"good")}}
        marker = {"step": step, "architecture": {}, "checksum": "crc32", "files": files, "world_size": 1}
        (tag / COMPLETE).write_text(json.dumps(marker))
    take(run, 14)
    cfg = load_config("configs/tiny_cpu.yaml", ["checkpoint.memory_every=2", f"checkpoint.memory_dir={run.memory}"])
    manager = CheckpointManager(run.checkpoints, rank=0, world_size=1, keep_last=2)
    restore_snapshots(cfg, Place(0, 1, None, ("node1",)), run, manager)
    assert (run.checkpoints / "step00000014" / COMPLETE).is_file()
    assert manager.choose_resume_tag(verify=True) == "step00000014"
    assert list(run.root.iterdir()) == []  # the resume reads no snapshot again: freed


def test_a_copied_run_folder_is_a_run_of_its_own(world, run, tmp_path, caplog):
    """snap_copy_branch: `cp -a` of a run folder copies its run_id, but the copy gets an id of its own, takes none
    of the original's snapshots and frees none of them."""
    take(run, 14)
    copy = tmp_path / "branch"
    shutil.copytree(run.path, copy)
    with caplog.at_level(logging.INFO, logger="txl_dist.training"):
        identity = run_id(copy, 0, run.memory)
    assert identity != RUN and "was made for another run folder" in caplog.text
    assert read_run_id(copy / RUN_ID, str(copy.resolve())) == (identity, "")
    branch = Snapshots(run.memory, RUN, copy, 0, 1, ["node1"])  # even with the original's id, its folder differs
    manager = CheckpointManager(copy / "checkpoints", rank=0, world_size=1, keep_last=2)
    assert branch.restore(copy / "checkpoints", manager.mark_complete, -1) is None
    assert "it belongs to the run folder" in caplog.text
    assert (run.root / "rank00000" / "step00000014" / SNAPSHOT).is_file()


@pytest.mark.parametrize("text", ["garbage\n", RUN.upper() + "\n", '{"run_id": 7}', "\xff"])
def test_an_unreadable_run_id_is_said_and_its_snapshots_adopted(world, run, text, caplog):
    """runid_garbage / runid_upper: the file is named in one line, and the snapshots in memory that name this run
    folder keep their id (the restore finds them), instead of a new id orphaning them in silence."""
    take(run, 14)
    (run.path / RUN_ID).write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff")
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert run_id(run.path, 0, run.memory) == RUN
    (line,) = [r.getMessage() for r in caplog.records if RUN_ID in r.getMessage()]
    assert f"{run.path / RUN_ID} cannot be read (" in line and "memory snapshots" in line
    assert json.loads((run.path / RUN_ID).read_text())["run_id"] == RUN
    shutil.rmtree(run.root)
    (run.path / RUN_ID).write_text("garbage\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert run_id(run.path, 0, run.memory) != RUN
    assert "no memory snapshot of this run folder is in" in caplog.text


def test_a_run_id_of_the_first_format_stays_the_runs(run):
    (run.path / RUN_ID).write_text(RUN + "\n")
    assert read_run_id(run.path / RUN_ID, str(run.path.resolve())) == (RUN, "")


def test_a_full_memory_folder_costs_only_the_snapshots_protection(world, run, tmp_path, caplog):
    """md_full: the run trains on; one warning names the folder and the cause, nothing partial stays, the next
    snapshots fail quietly, and one that fits again is said."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip() or 'not root'})")
    try:
        taker = Snapshots(mount, RUN, run.path, 0, 1, ["node1"])
        facts = {"world_size": 1, "streams_per_rank": 8, "architecture": {}, "zero_stage": 2}

        def snapshot(step: int, size: int) -> float | None:
            tag_dir = Path(f"/t/step{step:08d}")
            job = SimpleNamespace(path=tag_dir / "state.pt", write=lambda handle: handle.write(b"x" * size))
            return taker.take([job], tag_dir, CheckpointRecord(step=step, **facts))

        with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
            assert snapshot(2, 2**20) is None
            assert snapshot(4, 2**20) is None
            assert snapshot(6, 1) is not None
        failures = [r.getMessage() for r in caplog.records if "is not taken" in r.getMessage()]
        assert len(failures) == 1 and "no space left on device" in failures[0] and str(mount) in failures[0]
        assert "memory snapshots are taken again (step 6)" in caplog.text
        assert [p.name for p in (mount / f"txl_dist-{RUN}" / "rank00000").iterdir()] == ["step00000006"]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_memory_folder_that_cannot_hold_snapshots_leaves_the_run_without_them(world, run, tmp_path, caplog):
    blocked = tmp_path / "a_file"
    blocked.write_text("in the way\n")
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert not Snapshots(blocked, RUN, run.path, 0, 1, ["node1"]).taking
    assert "no memory snapshots in this start" in caplog.text and str(blocked) in caplog.text
    foreign = tmp_path / "shared"
    (foreign / f"txl_dist-{RUN}").mkdir(parents=True)
    os.chown(foreign / f"txl_dist-{RUN}", 12345, 12345)  # made by another account (root runs the tests)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert not Snapshots(foreign, RUN, run.path, 0, 1, ["node1"]).taking
    assert "owned by another account" in caplog.text
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / f"txl_dist-{RUN}").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert not Snapshots(linked, RUN, run.path, 0, 1, ["node1"]).taking  # another account's link to its folder
    assert "a symbolic link or no folder" in caplog.text


def test_a_copy_from_another_node_that_is_no_snapshot_is_refused():
    """The ring's payload is checked as a folder's manifest is: a foreign or damaged buffer is a ValueError (the
    copy is lost with a warning), never files written from it."""
    from txl_dist.checkpoints.snapshot_files import pack, unpack

    good = {
        "run_id": RUN,
        "output_dir": "/runs/x",
        "rank": 0,
        "step": 4,
        "world_size": 2,
        "host": "n1",
        "streams_per_rank": 2,
        "architecture": {},
        "zero_stage": 2,
        "files": {"a.pt": {"bytes": 1, "crc32": crc32(b"x")}},
    }
    assert unpack(memoryview(pack(good, {"a.pt": b"x"})))[1] == {"a.pt": b"x"}
    evil = {**good, "files": {"../a.pt": {"bytes": 1, "crc32": crc32(b"x")}}}
    with pytest.raises(ValueError, match=r"lists the file '\.\./a\.pt'"):
        unpack(memoryview(pack(evil, {"../a.pt": b"x"})))
    with pytest.raises(ValueError, match="shorter than its header"):
        unpack(memoryview(b"123"))


def test_a_memory_folder_on_a_disk_is_said_once(world, run, caplog):
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        assert Snapshots(run.memory, RUN, run.path, 0, 1, ["node1"]).taking
    assert "is on a" in caplog.text and "file system, not in memory" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        in_memory = Snapshots("/dev/shm", RUN, run.path, 0, 1, ["node1"])
    try:
        in_memory.free("test")
    finally:
        shutil.rmtree(in_memory.root, ignore_errors=True)  # the machine's own /dev/shm: nothing left behind
    assert "not in memory" not in caplog.text


@pytest.mark.parametrize(
    "memory_every, resume, restored",
    [(0, True, False), (2, False, False), (2, True, True)],
    ids=["memory_every=0", "resume=false", "restored"],
)
def test_every_snapshot_an_earlier_start_left_is_restored_or_freed(world, run, memory_every, resume, restored, caplog):
    """snap_relaunch_off, d2_restore_w1, snap_resume_false: at start each snapshot of the run is written back or
    removed, the old ranks' folders after a shrink included, and the log names them; a run that will not resume
    restores nothing."""
    take(run, 12, rank=0, world_size=2)
    take(run, 12, rank=1, world_size=2)  # a world of 2 before a shrink to 1
    overrides = [f"checkpoint.memory_every={memory_every}", f"checkpoint.memory_dir={run.memory}"]
    cfg = load_config("configs/tiny_cpu.yaml", [*overrides, f"checkpoint.resume={str(resume).lower()}"])
    manager = CheckpointManager(run.checkpoints, rank=0, world_size=1, keep_last=2)
    with caplog.at_level(logging.WARNING, logger="txl_dist.training"):
        restore_snapshots(cfg, Place(0, 1, None, ("node1",)), run, manager)
    assert list(run.root.iterdir()) == []
    assert "removed the memory snapshots rank00000/step00000012, rank00001/step00000012" in caplog.text
    assert (run.checkpoints / "step00000012" / COMPLETE).is_file() == restored


@pytest.mark.parametrize("value", ["''", "shm", "./shm", "$HOME/shm"])
def test_memory_dir_is_an_absolute_path(value):
    with pytest.raises(ConfigError, match="checkpoint.memory_dir=.* is not allowed: an absolute path"):
        load_config("configs/tiny_cpu.yaml", [f"checkpoint.memory_dir={value}"])
    home = load_config("configs/tiny_cpu.yaml", ["checkpoint.memory_dir=~/shm"]).checkpoint.memory_dir
    assert home == os.path.join(os.path.expanduser("~"), "shm")


def _two_ranks(rank: int, store: str, memory: list[str], output: str, verdicts: str) -> None:
    """One rank of `test_the_ranks_agree_whether_snapshots_are_taken`, on a host of its own."""
    # A short timeout: ranks that disagree wait in a collective the other never joins, and fail instead of hanging.
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timeout)
    try:
        taker = Snapshots(memory[rank], RUN, Path(output), rank, 2, ["node1", "node2"])
        Path(verdicts, str(rank)).write_text(str(taker.taking))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_ranks_agree_whether_snapshots_are_taken(tmp_path):
    """One node's memory folder cannot hold snapshots (a file in the way): every rank goes without them, instead
    of one rank building the ring's group alone and the others waiting for it."""
    import torch.multiprocessing as mp

    blocked = tmp_path / "a_file"
    blocked.write_text("in the way\n")
    memory = [str(tmp_path / "memory"), str(blocked)]
    verdicts = tmp_path / "verdicts"
    verdicts.mkdir()
    arguments = (str(tmp_path / "store"), memory, str(tmp_path / "run"), str(verdicts))
    mp.start_processes(_two_ranks, args=arguments, nprocs=2, start_method="fork")  # torch is loaded: fork is quick
    assert {path.name: path.read_text() for path in verdicts.iterdir()} == {"0": "False", "1": "False"}
