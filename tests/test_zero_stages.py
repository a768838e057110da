"""A checkpoint resumes under another ZeRO stage and another number of ranks, with its fp32 master weights, Adam's
moments and step, and the schedule (`txl_dist.checkpoints.universal`); a world that cannot hold the global
batch is refused in one line naming those that can.

One uninterrupted run (ZeRO-0, one rank, 8 steps, a checkpoint every 2) is the reference; dropout is off and every
stage and world size steps on the same global batch of the same streams, so every run's step t has the
reference's loss, up to the order of the sums. Each case resumes a copy of an earlier run's checkpoint under
another stage on another number of ranks, and later cases start from the checkpoints earlier cases wrote (so
that each stage's checkpoints come from a real run of that stage, at the cost of five runs in all). The first
step after a resume has the reference's loss only if the fp32 masters came across, the later ones only if Adam's
moments, its step count and the learning rate did too: with the moments restarted from zero the first update is
lr x sign(gradient), which moves the next loss by ~1e-3 relative here, a hundred times the tolerance.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.launcher import copy_at_step, records, run, torchrun_command
from txl_dist.config import load_config

pytestmark = pytest.mark.launcher

TRAIN = "launchers/train.py"
STEPS = 8


def _args(shards: Path, output: Path, stage: int, *extra: str) -> list[str]:
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.shards={shards}",
        f"train.output_dir={output}",
        f"zero.stage={stage}",
        "zero.stage3_param_persistence_threshold=0",  # the tiny model's tensors are partitioned too
        "model.dropout=0.0",
        "model.init_std=0.5",
        "optim.lr=5e-3",
        "schedule.warmup_steps=2",
        "schedule.total_steps=40",
        f"train.max_steps={STEPS}",
        "checkpoint.every=2",
        "checkpoint.keep_last=0",
        "log.every=1",
        "eval.every=0",
        "eval.batch_size=64",
        "eval.tgt_len=32",
        *extra,
    ]


def _train(ranks: int, args: list[str]) -> str:
    command = torchrun_command(TRAIN, args, nprocs=ranks) if ranks > 1 else [sys.executable, TRAIN, *args]
    result = run(command)
    return result.stdout + result.stderr


class Case(NamedTuple):
    source: str
    """The run whose checkpoint is resumed ("reference": the uninterrupted one)."""
    step: int
    stage: int
    ranks: int


CASES = {
    "0on1-to-3on2": Case("reference", 2, stage=3, ranks=2),
    "3on2-to-2on1": Case("0on1-to-3on2", 4, stage=2, ranks=1),
    "3on2-to-1on1": Case("0on1-to-3on2", 4, stage=1, ranks=1),
    "2on1-to-3on2": Case("3on2-to-2on1", 6, stage=3, ranks=2),
}


class Runs:
    """The reference run and the resumed runs, each run once per module when a test first needs it."""

    def __init__(self, shards: Path, root: Path):
        self.shards, self.root = shards, root
        self.done: dict[str, tuple[Path, str]] = {}

    def get(self, name: str) -> tuple[Path, str]:
        """The run's output directory and its log."""
        if name not in self.done:
            if name == "reference":
                output = self.root / name
                self.done[name] = output, _train(1, _args(self.shards, output, 0))
            else:
                case = CASES[name]
                output = copy_at_step(self.get(case.source)[0], case.step, self.root / name)
                self.done[name] = output, _train(case.ranks, _args(self.shards, output, case.stage))
        return self.done[name]


@pytest.fixture(scope="module")
def runs(ptb_word_shards, tmp_path_factory) -> Runs:
    return Runs(ptb_word_shards, tmp_path_factory.mktemp("zero_stages"))


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_resumes_under_another_zero_stage_and_world_size(runs, name):
    case = CASES[name]
    resumed, log = runs.get(name)
    assert f"into ZeRO stage {case.stage} on {case.ranks} ranks, converted by txl_dist" in log
    assert f"at step {case.step} (exact" in log
    # Every save logs how long it took, its size and the rate.
    assert re.search(rf"checkpoint \S+/step{STEPS:08d} written in \d+\.\d\d s \(\d+\.\d MB, \d+ MB/s\)", log)
    expected, got = records(runs.get("reference")[0]), records(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(case.step + 1, STEPS + 1):
        assert got[step]["data_checksum"] == expected[step]["data_checksum"], step
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
        assert got[step]["lr"] == pytest.approx(expected[step]["lr"], rel=1e-9), step
    assert not any(path.name.endswith("_universal") for path in (resumed / "checkpoints").iterdir())


def test_the_resume_plan_loads_as_saved_through_deepspeed_or_converted_as_deepspeed_0_19_8_allows():
    from txl_dist.checkpoints.universal import LoadKind, plan_load

    as_saved, universal, converted = LoadKind.AS_SAVED, LoadKind.UNIVERSAL, LoadKind.CONVERTED
    # (saved stages, saved ranks, optimizer partitions per rank, stage, ranks) -> how
    table = {
        ((2,), 2, True, 1, 2): as_saved,  # ZeRO 1 and 2 share one optimizer and one layout
        ((3,), 2, True, 3, 2): as_saved,
        ((0,), 1, False, 0, 4): as_saved,  # ZeRO-0's state is whole on every rank
        ((2,), 2, True, 1, 1): universal,
        ((3,), 2, True, 3, 4): universal,
        ((1, 2), 2, True, 2, 4): universal,  # a checkpoint that did not record its stage, told by its files
        ((0,), 1, False, 3, 2): converted,
        ((2,), 2, True, 3, 2): converted,  # the same ranks: DeepSpeed still loads no other stage's files
        ((3,), 2, True, 2, 1): converted,
        ((3,), 2, True, 0, 2): converted,
        ((1, 2), 2, True, 3, 2): converted,
        ((0, 1, 2), 2, True, 1, 2): converted,  # could be ZeRO-0's bf16 files: converted, never guessed
    }
    assert {case: plan_load(*case) for case in table} == table


# ---- the global batch is kept: a world that cannot hold it is refused ------------------------------------------


def _train_config(*overrides: str):
    return load_config([Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"], list(overrides)).train


@pytest.mark.parametrize(
    ("overrides", "world_size", "holding"),
    [
        (["train.global_batch=8", "train.micro_batch=4"], 3, "1, 2"),
        (["train.global_batch=8", "train.micro_batch=2"], 3, "1, 2, 4"),
        (["train.global_batch=12", "train.micro_batch=null"], 5, "1, 2, 3, 4, 6, 12"),
        (["train.global_batch=8", "train.micro_batch=8"], 2, "1"),
    ],
)
def test_a_world_that_cannot_hold_the_global_batch_is_refused_naming_those_that_can(overrides, world_size, holding):
    train = _train_config(*overrides)
    with pytest.raises(ValueError) as refused:
        train.batch_split(world_size)
    message = str(refused.value)
    assert "\n" not in message
    assert f"train.global_batch={train.global_batch} with train.micro_batch" in message
    assert f"cannot be split over {world_size} ranks" in message
    assert f"the world sizes that can hold it are {holding};" in message
    for size in map(int, holding.split(", ")):
        layout = train.batch_split(size)
        assert layout.micro_batch * layout.grad_accum * size == train.global_batch


def test_a_resumed_world_that_cannot_hold_the_global_batch_stops_before_training(runs, tmp_path):
    """The one-rank run's global batch of 8 streams, in micro-batches of 8, fits one rank only: resumed on two,
    the ranks stop before any process group starts, with one line naming the world sizes that can hold it."""
    resumed = copy_at_step(runs.get("reference")[0], 2, tmp_path / "resumed")
    before = (resumed / "metrics.jsonl").read_text()
    args = _args(runs.shards, resumed, 0, "train.micro_batch=8")
    result = run(torchrun_command(TRAIN, args, nprocs=2), check=False)
    assert result.returncode != 0
    expected = (
        "train.global_batch=8 with train.micro_batch=8 cannot be split over 2 ranks (global_batch / (micro_batch x "
        "world_size) accumulation steps must be whole): the world sizes that can hold it are 1;"
    )
    lines = [line for line in (result.stdout + result.stderr).splitlines() if expected in line]
    assert len(lines) == 1, result.stderr[-3000:]
    assert (resumed / "metrics.jsonl").read_text() == before
    assert sorted(path.name for path in (resumed / "checkpoints").iterdir() if path.name.startswith("step")) == [
        "step00000002"
    ]
