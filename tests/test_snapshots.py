"""txl_dist.checkpoints.snapshots without a process group: a snapshot's files and manifest in a node's memory
folder, what a restore may trust, and the ring of copies (taking and restoring them under DeepSpeed:
tests/test_train_launcher.py; across nodes, with a node's memory lost: tests/cluster/test_recovery.py)."""

from __future__ import annotations

import json

import pytest

from txl_dist.checkpoints.snapshot_files import (
    SNAPSHOT,
    Ring,
    crc32,
    pack,
    prune,
    unpack,
    verified_snapshots,
    write_snapshot,
)

RUN = "0" * 31 + "1"
RUN_DIR = "/runs/tiny"


def manifest_of(files: dict[str, bytes], rank: int = 0, step: int = 12, run_id: str = RUN, **more) -> dict:
    """A snapshot's manifest as `Snapshots.take` writes it."""
    return {
        "run_id": run_id,
        "output_dir": RUN_DIR,
        "rank": rank,
        "step": step,
        "world_size": 2,
        "host": "node1",
        "streams_per_rank": 4,
        "architecture": {"n_layer": 2},
        "zero_stage": 2,
        "health": {"loss": 3.5, "grad_norm": 0.25},
        "files": {name: {"bytes": len(data), "crc32": crc32(data)} for name, data in files.items()},
        **more,
    }


FILES = {"mp_rank_00_model_states.pt": b"model" * 100, "txl_rank_states/rank00000.pt": b"rank state"}


def test_a_snapshot_travels_as_one_buffer_and_comes_back_whole():
    manifest = manifest_of(FILES)
    again, files = unpack(memoryview(pack(manifest, FILES)))
    assert again == manifest and files == FILES


def test_a_snapshot_is_written_whole_or_not_at_all(tmp_path):
    folder = tmp_path / "rank00000" / "step00000012"
    write_snapshot(folder, manifest_of(FILES), FILES)
    assert json.loads((folder / SNAPSHOT).read_text())["step"] == 12
    assert (folder / "txl_rank_states" / "rank00000.pt").read_bytes() == b"rank state"
    damaged = {**FILES, "mp_rank_00_model_states.pt": b"mode1" * 100}  # same size, other bytes
    with pytest.raises(ValueError, match="mp_rank_00_model_states.pt of rank 0 does not match its checksum"):
        write_snapshot(tmp_path / "rank00000" / "step00000015", manifest_of(FILES, step=15), damaged)
    assert sorted(path.name for path in (tmp_path / "rank00000").iterdir()) == ["step00000012"]


def test_only_the_newest_two_snapshots_of_a_rank_are_kept(tmp_path):
    rank_dir = tmp_path / "rank00001"
    for step in (3, 6, 9, 12):
        write_snapshot(rank_dir / f"step{step:08d}", manifest_of(FILES, rank=1, step=step), FILES)
    (rank_dir / ".step00000015.0123456789abcdef.tmp").mkdir()  # a write that was stopped
    prune(rank_dir)
    assert sorted(path.name for path in rank_dir.iterdir()) == ["step00000009", "step00000012"]


def test_a_restore_trusts_only_this_runs_snapshots_whose_files_match(tmp_path, caplog):
    write_snapshot(tmp_path / "rank00000" / "step00000012", manifest_of(FILES), FILES)
    write_snapshot(tmp_path / "rank00001" / "step00000012", manifest_of(FILES, rank=1), FILES)
    write_snapshot(tmp_path / "rank00000" / "step00000009", manifest_of(FILES, step=9, run_id="f" * 32), FILES)
    write_snapshot(tmp_path / "rank00001" / "step00000009", manifest_of(FILES, rank=1, step=9), FILES)
    (tmp_path / "rank00001" / "step00000012" / "mp_rank_00_model_states.pt").write_bytes(b"torn")
    found = verified_snapshots(tmp_path, RUN, RUN_DIR)
    assert sorted(found) == [(0, 12), (1, 9)]
    assert "rank00001/step00000012 skipped: mp_rank_00_model_states.pt does not match its checksum" in caplog.text
    assert "rank00000/step00000009 skipped: it belongs to another run" in caplog.text


@pytest.mark.parametrize(
    "hosts, rank, partner, senders",
    [
        (["a"], 0, None, []),
        (["a", "a"], 1, None, []),  # one node: nothing to copy to
        (["a", "b"], 0, 1, [1]),
        (["a", "a", "b", "b", "c", "c"], 1, 3, [5]),  # node a's second rank -> node b's second, from node c's
        (["a", "a", "b", "b", "c", "c"], 4, 0, [2]),  # the last node's copies go to the first
    ],
)
def test_each_rank_copies_to_the_rank_in_its_place_on_the_next_node(hosts, rank, partner, senders):
    assert Ring.of(hosts, rank) == Ring(partner, senders)


def test_a_failure_line_says_what_the_memory_snapshots_keep():
    """d2_kill_rank1: the line said the progress since the last checkpoint was lost while a snapshot kept it."""
    from txl_dist.supervision.guard import RunGuard

    guard = RunGuard(watch_launcher=False, install_signals=False)
    try:
        guard.checkpointed(5)
        assert "since its last checkpoint (step 5) is lost" in guard.death_message([(1, "")])
        guard.snapshotted(8)
        said = guard.death_message([(1, "")])
        assert "since its last checkpoint (step 5) is kept up to step 8 by the memory snapshots" in said, said
        guard.checkpointed(10)  # a newer checkpoint: the snapshot no longer adds anything
        assert "since its last checkpoint (step 10) is lost" in guard.death_message([(1, "")])
    finally:
        guard.close()
