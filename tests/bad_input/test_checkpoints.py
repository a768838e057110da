"""Bad input to txl_dist.checkpoints: completion markers (COMPLETE.json) whose fields are of another kind
(checkpoints.verify), and a run resumed under another ZeRO stage (checkpoints.universal; a real launcher run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.bad_input.helpers import _parse_run

# ---- completion markers with a field of another kind -----------------------------------------------------------------


def _checkpoint(tag_dir: Path) -> Path:
    from txl_dist import fileio

    tag_dir.mkdir(parents=True)
    written = fileio.atomic_write_checksummed(tag_dir / "mp_rank_00_model_states.pt", lambda h: h.write(b"x" * 99))
    marker = {
        "step": 5,
        "world_size": 1,
        "streams_per_rank": 2,
        "checksum": "crc32",
        "files": {"mp_rank_00_model_states.pt": written.to_json()},
    }
    (tag_dir / "COMPLETE.json").write_text(json.dumps(marker))
    return tag_dir


@pytest.mark.parametrize(
    "change, message",
    [
        ({"checksum": "sha512"}, r"checksum 'sha512' is not one that txl_dist checks \(it records 'crc32'\)"),
        ({"checksum": None}, r"lists no file checksums \(a checkpoint written before txl_dist verified"),
        ({"files": ["mp_rank_00_model_states.pt"]}, r"'files' is list .*, not a mapping of file names"),
        (
            {"files": {"mp_rank_00_model_states.pt": {"bytes": "99", "crc32": "0"}}},
            r"entry of 'mp_rank_00.*\"bytes\" is '99'",
        ),
        (
            {"files": {"mp_rank_00_model_states.pt": {"bytes": 99, "crc32": 7}}},
            r"\"crc32\" is 7, not eight hexadecimal",
        ),
        (
            {"files": {"mp_rank_00_model_states.pt": 99}},
            r"entry of 'mp_rank_00_model_states.pt' is malformed: 99 is not",
        ),
        ({"world_size": "2"}, r"'world_size' is '2', not a number of ranks \(a damaged marker\)"),
        ({"step": 5.0}, r"'step' is 5.0, not a step number"),
        ({"streams_per_rank": True}, r"'streams_per_rank' is True, not a number of streams"),
    ],
)
def test_a_completion_marker_with_a_field_of_another_kind_is_named(tmp_path, change, message):
    from txl_dist.checkpoints.verify import verify_checkpoint

    tag_dir = _checkpoint(tmp_path / "step00000005")
    assert verify_checkpoint(tag_dir) == []
    marker = json.loads((tag_dir / "COMPLETE.json").read_text())
    marker.update(change)
    if change.get("checksum", "") is None:
        del marker["checksum"]
    (tag_dir / "COMPLETE.json").write_text(json.dumps(marker))
    problems = verify_checkpoint(tag_dir)
    assert len(problems) == 1 and problems[0].startswith(f"{tag_dir / 'COMPLETE.json'}")
    assert re.search(message, problems[0]), problems[0]


# ---- resuming with another ZeRO stage --------------------------------------------------------------------------------


@pytest.mark.launcher
def test_another_zero_stage_is_accepted_before_any_rank_starts_and_stages_1_and_2_resume_each_other(
    small_shards, tmp_path
):
    """Every stage loads every other's checkpoint now (tests/test_zero_stages.py resumes them), so the command line
    no longer refuses one; ZeRO 1 and 2 load each other's checkpoints as saved, exactly."""
    import sys

    from tests.launcher import copy_at_step, records, run
    from txl_dist.checkpoints.universal import LoadKind, plan_load
    from txl_dist.checkpoints.verify import read_marker, saved_zero_stages
    from txl_dist.convert.zero import consolidate_weights, read_training_checkpoint

    settings = [f"data.shards={small_shards}", "train.max_steps=4", "checkpoint.every=2", "eval.every=0", "log.every=1"]
    first = tmp_path / "zero2"
    run(
        [
            sys.executable,
            "launchers/train.py",
            "--config",
            "configs/tiny_cpu.yaml",
            *settings,
            f"train.output_dir={first}",
        ]
    )
    tag_dir = first / "checkpoints" / "step00000004"
    assert json.loads((tag_dir / "COMPLETE.json").read_text())["zero_stage"] == 2
    for stage in (3, 0):
        cfg, _ = _parse_run(*settings, f"train.output_dir={first}", f"zero.stage={stage}")
        assert cfg.zero.stage == stage
    # A checkpoint written before COMPLETE.json recorded the stage: told by DeepSpeed's file names, and converted.
    marker = read_marker(tag_dir)
    del marker["zero_stage"]
    assert saved_zero_stages(tag_dir, marker) == (1, 2)
    assert plan_load((1, 2), 1, True, 1, 1) is LoadKind.AS_SAVED
    assert plan_load((1, 2), 1, True, 3, 1) is LoadKind.CONVERTED

    # ZeRO-1 continues ZeRO-2's checkpoint exactly: the same losses and the same weights.
    second = copy_at_step(first, 2, tmp_path / "zero1")
    run(
        [
            sys.executable,
            "launchers/train.py",
            "--config",
            "configs/tiny_cpu.yaml",
            *settings,
            f"train.output_dir={second}",
            "zero.stage=1",
        ]
    )
    for step in (3, 4):
        assert records(second)[step]["loss"] == records(first)[step]["loss"]
    weights = [consolidate_weights(read_training_checkpoint(run_dir)) for run_dir in (first, second)]
    assert json.loads((second / "checkpoints" / "step00000004" / "COMPLETE.json").read_text())["zero_stage"] == 1
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
