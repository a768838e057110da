"""Trainer paths on 2 CPU ranks (started by torchrun: what is tested is the trainer, not the launcher), each checked
against an oracle computed here without the trainer: every micro-batch slot feeds its own streams' memory,
train.max_epochs, eval.max_batches, resume on another number of ranks, and resume after the global batch changed.

The oracles read the token stream straight from the shards (webdataset), cut it as docs/architecture.md (Streams)
says, and run the model of a checkpoint's weights over it. Dropout is off in these runs, so a loss depends only on
the weights, the tokens and the memory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.launcher import copy_at_step, records, run, torchrun_command
from tests.oracles import checkpoint_model, stream_tokens

pytestmark = pytest.mark.launcher

TRAIN = "launchers/train.py"


@torch.no_grad()
def step_losses(model, rows: torch.Tensor, tgt_len: int, steps: int, mems_for=lambda mems, step: mems) -> list[float]:
    """Mean loss per step of ``rows`` [streams, tokens] read as contiguous streams: window t is tokens
    [t*tgt_len, (t+1)*tgt_len] of every row; the memory of each step goes, through ``mems_for``, to the next."""
    losses, mems = [], None
    for step in range(steps):
        window = rows[:, step * tgt_len : (step + 1) * tgt_len + 1]
        loss, mems = model(window[:, :-1], window[:, 1:], mems_for(mems, step) if mems is not None else None)
        losses.append(loss.double().mean().item())
    return losses


# ---- each slot's own memory, max_epochs, max_batches -----------------------------------------------------------

# 2 ranks x 2 micro-batches (slots) x 32 streams, segments of 16 tokens, a memory of 24 (more than one segment).
SLOTS, ROWS, TGT_LEN, MEM_LEN = 2, 32, 16, 24
EVAL = dict(batch_size=8, tgt_len=16, mem_len=20, max_batches=3, every=10)


@pytest.fixture(scope="module")
def still(ptb_word_shards, tmp_path_factory) -> Path:
    """One epoch of PTB test (40 steps of 128 streams) with a learning rate of 1e-12: the weights stay as they
    were drawn, so that every step's loss follows from the first checkpoint's weights and the tokens. The weights
    are drawn with std 0.5 (not 0.02), which makes the loss depend on the memory by ~1e-3 (at 0.02, by ~1e-6)."""
    output = tmp_path_factory.mktemp("still")
    run(
        torchrun_command(
            TRAIN,
            [
                "--config",
                "configs/tiny_cpu.yaml",
                f"data.shards={ptb_word_shards}",
                f"train.output_dir={output}",
                "data.train_split=test",
                f"model.tgt_len={TGT_LEN}",
                f"model.mem_len={MEM_LEN}",
                "model.dropout=0.0",
                "model.init_std=0.5",
                f"train.global_batch={2 * SLOTS * ROWS}",
                f"train.micro_batch={ROWS}",
                "train.max_epochs=1",
                "train.max_steps=100000",
                "optim.lr=1e-12",
                "log.every=1",
                *[f"eval.{key}={value}" for key, value in EVAL.items()],
                "checkpoint.every=0",
                "checkpoint.keep_last=0",
            ],
        )
    )
    return output


def test_every_slot_trains_on_its_own_streams_memory(still, ptb_word_shards):
    """Each logged loss equals the oracle's, which carries every stream's memory to its next segment; the same
    oracle with the memory left out, swapped between a rank's two slots, or moved one row over differs from the
    logged losses by far more than the tolerance -- so the comparison can tell."""
    tokens = stream_tokens(ptb_word_shards, "test")
    streams = 2 * SLOTS * ROWS
    per_stream = len(tokens) // streams
    steps = (per_stream - 1) // TGT_LEN
    logged = records(still)
    assert sorted(logged) == list(range(1, steps + 1))
    model, _ = checkpoint_model(still)
    rows = tokens[: streams * per_stream].view(streams, per_stream)
    right = step_losses(model, rows, TGT_LEN, steps)
    got = [logged[step]["loss"] for step in range(1, steps + 1)]
    error = max(abs(a - b) / b for a, b in zip(right, got))
    print(f"max relative difference, trainer vs oracle over {steps} steps: {error:.2e}")
    assert error < 1e-5

    slot_of = torch.arange(streams) // ROWS  # rank r's slots are slot_of 2r and 2r + 1
    other_slot = torch.arange(streams) + torch.where(slot_of % 2 == 0, ROWS, -ROWS)
    next_row = slot_of * ROWS + (torch.arange(streams) + 1) % ROWS
    wrong = {
        "no memory": lambda mems, step: None,
        "the other slot's memory": lambda mems, step: [m[:, other_slot] for m in mems],
        "the next row's memory": lambda mems, step: [m[:, next_row] for m in mems],
    }
    for name, mems_for in wrong.items():
        losses = step_losses(model, rows, TGT_LEN, steps, mems_for)
        assert losses[0] == right[0]  # no memory yet at the first step
        difference = max(abs(a - b) / b for a, b in zip(losses, got))
        print(f"{name}: max relative difference {difference:.2e}")
        assert difference > 30 * max(error, 1e-6), name


def test_max_epochs_stops_at_the_end_of_the_epoch_with_the_data_position_of_the_next(still, ptb_word_shards):
    from txl_dist.data.format import read_manifest

    streams = 2 * SLOTS * ROWS
    steps = (read_manifest(ptb_word_shards).splits["test"].tokens // streams - 1) // TGT_LEN
    checkpoints = sorted(p.name for p in (still / "checkpoints").iterdir() if p.name.startswith("step"))
    # checkpoint.every=0 saves at the end only, and a sampled evaluation is never a "best" to save.
    assert checkpoints == [f"step{steps:08d}"]
    _, checkpoint = checkpoint_model(still)
    data = checkpoint.client["data"]
    assert (checkpoint.client["step"], data["epoch"], data["step"], data["position"]) == (steps, 1, 0, 0)
    assert checkpoint.client["tokens_seen"] == steps * streams * TGT_LEN


def test_sampled_evaluations_score_the_first_max_batches_windows_of_every_stream(still, ptb_word_shards):
    """eval.max_batches=3 during training: exactly 3 windows of each of the 8 evaluation streams, scored as an
    oracle scores them here (stream s starts at target s * n + min(s, extra), EvalStreams' rule); the full pass
    after the last step scores every target, and only it counts as the best."""
    evaluations = [
        json.loads(line)
        for line in (still / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ]
    steps = max(records(still))
    sampled, final = evaluations[:-1], evaluations[-1]
    assert [e["step"] for e in sampled] == list(range(EVAL["every"], steps + 1, EVAL["every"]))
    tokens = stream_tokens(ptb_word_shards, "valid")
    assert final["step"] == steps and final["targets"] == len(tokens) - 1

    per_stream, extra = divmod(len(tokens) - 1, EVAL["batch_size"])
    starts = [s * per_stream + min(s, extra) for s in range(EVAL["batch_size"])]
    span = EVAL["max_batches"] * EVAL["tgt_len"] + 1
    rows = torch.stack([tokens[start : start + span] for start in starts])
    model, checkpoint = checkpoint_model(still, mem_len=EVAL["mem_len"], tgt_len=EVAL["tgt_len"])
    expected = sum(step_losses(model, rows, EVAL["tgt_len"], EVAL["max_batches"])) / EVAL["max_batches"]
    for evaluation in sampled:
        assert evaluation["targets"] == EVAL["batch_size"] * EVAL["max_batches"] * EVAL["tgt_len"]
        assert evaluation["loss"] == pytest.approx(expected, rel=1e-5), evaluation
    assert checkpoint.client["best"]["step"] == steps
    assert checkpoint.client["best"]["loss"] == pytest.approx(final["loss"], rel=1e-12)


# ---- resume on another number of ranks, and with another global batch -------------------------------------------


def settled_args(shards: Path, output_dir: Path, *extra: str) -> list[str]:
    """The tiny model as in tests/test_train_launcher.py's reference run, without dropout, its weights drawn with
    std 0.5: at 0.02 another stream's memory moves a step's loss by at most ~1e-5, too little to tell."""
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        f"data.shards={shards}",
        f"train.output_dir={output_dir}",
        "model.dropout=0.0",
        "model.init_std=0.5",
        "optim.lr=5e-3",
        "schedule.warmup_steps=2",
        "schedule.total_steps=40",
        "log.every=1",
        "eval.every=0",
        "eval.batch_size=64",
        "eval.tgt_len=32",
        "checkpoint.every=10",
        "checkpoint.keep_last=0",
        *extra,
    ]


@pytest.fixture(scope="module")
def settled(ptb_word_shards, tmp_path_factory) -> Path:
    """20 steps on 2 ranks, checkpoints at steps 10 and 20."""
    output = tmp_path_factory.mktemp("settled")
    run(torchrun_command(TRAIN, settled_args(ptb_word_shards, output, "train.max_steps=20")))
    return output


def test_resume_on_one_rank_equals_the_two_rank_continuation(settled, ptb_word_shards, tmp_path):
    """The 2-rank ZeRO-2 checkpoint goes through DeepSpeed's universal format to one plain `python` process (4
    accumulation steps instead of 2); the same streams continue with their memory and Adam's moments, so the
    losses equal those of the 2-rank run up to the order of the sums (here they come out equal). The first step
    after the resume is also the loss of the step-10 weights on the streams' next windows with the memory the
    checkpoint holds for each stream; with every stream's memory moved to the next column it would differ."""
    from txl_dist.data import ResumeKind, TrainStreams

    output = copy_at_step(settled, 10, tmp_path / "one_rank")
    result = run([sys.executable, TRAIN, *settled_args(ptb_word_shards, output, "train.max_steps=20")])
    assert "universal format for 1 ranks" in result.stderr and "at step 10 (exact" in result.stderr
    assert "on 1 rank(s): global batch 8 = 1 ranks x micro-batch 2 x 4 accumulation" in result.stderr
    two, one = records(settled), records(output)
    assert sorted(one) == list(range(1, 21))
    tolerance = 1e-5
    for step in range(11, 21):
        assert one[step]["data_checksum"] == two[step]["data_checksum"], step
        assert one[step]["loss"] == pytest.approx(two[step]["loss"], rel=tolerance), step
    assert not any(p.name.endswith("_universal") for p in (output / "checkpoints").iterdir())

    model, checkpoint = checkpoint_model(output, "step00000010")
    with TrainStreams(
        ptb_word_shards, "train", tgt_len=8, micro_batch=2, grad_accum=4, world_size=1, rank=0
    ) as streams:
        assert streams.load_state_dict(checkpoint.client["data"]) == ResumeKind.EXACT
        windows = iter(streams)
        batches = [next(windows) for _ in range(4)]
    assert torch.cat([batch.stream_ids for batch in batches]).tolist() == list(range(8))
    inputs, targets = (torch.cat(parts) for parts in zip(*((batch.inputs, batch.targets) for batch in batches)))
    states = [
        torch.load(
            output / "checkpoints" / "step00000010" / "txl_rank_states" / f"rank{rank:05d}.pt", weights_only=True
        )
        for rank in range(2)
    ]
    assert [state["stream_ids"].tolist() for state in states] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    mems = [torch.cat(layers, dim=1) for layers in zip(*(state["mems"] for state in states))]  # [mem_len, 8, d]
    with torch.no_grad():
        expected = model(inputs, targets, mems)[0].double().mean().item()
        moved = model(inputs, targets, [m.roll(1, dims=1) for m in mems])[0].double().mean().item()
    assert one[11]["loss"] == pytest.approx(expected, rel=tolerance)
    assert abs(moved - expected) > 10 * tolerance * expected


def test_resume_with_another_global_batch_repartitions_the_rest_and_starts_without_memory(
    settled, ptb_word_shards, tmp_path
):
    """global_batch 8 -> 16 on the same 2 ranks (4 accumulation steps): the rest of the epoch is cut into 16
    streams. Each step reads what TrainStreams, loaded with the checkpoint's data state, gives for the new layout
    (the logged data checksum is the trainer's sum over ranks and slots), and the first step's loss is that of the
    step-10 weights on those windows without memory."""
    from txl_dist.data import ResumeKind, TrainStreams

    output = copy_at_step(settled, 10, tmp_path / "wider")
    result = run(
        torchrun_command(TRAIN, settled_args(ptb_word_shards, output, "train.max_steps=13", "train.global_batch=16"))
    )
    log = result.stderr
    assert "resume with 16 streams instead of 8: epoch 0 re-partitioned" in log
    assert "the number of streams changed; memory starts empty" in log and "at step 10 (repartitioned" in log

    model, checkpoint = checkpoint_model(output, "step00000010")
    checksums, first_windows = {step: 0 for step in (11, 12, 13)}, []
    for rank in range(2):
        streams = TrainStreams(
            ptb_word_shards, "train", tgt_len=8, micro_batch=2, grad_accum=4, world_size=2, rank=rank
        )
        assert streams.load_state_dict(checkpoint.client["data"]) == ResumeKind.REPARTITIONED
        batches = iter(streams)
        for step in (11, 12, 13):
            for _ in range(4):
                batch = next(batches)
                assert batch.reset_mems == (step == 11)
                checksums[step] += int((batch.inputs.sum(dim=1) * (batch.stream_ids + 1)).sum())
                if step == 11:
                    first_windows.append((batch.inputs, batch.targets))
        streams.close()
    logged = records(output)
    assert {step: logged[step]["data_checksum"] for step in (11, 12, 13)} == checksums
    with torch.no_grad():
        inputs, targets = (torch.cat(parts) for parts in zip(*first_windows))
        expected = model(inputs, targets)[0].double().mean().item()
    assert logged[11]["loss"] == pytest.approx(expected, rel=1e-5)
    # The premise: had the new streams 0-7 kept the memory of the old streams 0-7 (other text now), the loss
    # would differ by far more than the tolerance.
    old = [
        torch.load(
            output / "checkpoints" / "step00000010" / "txl_rank_states" / f"rank{rank:05d}.pt", weights_only=True
        )
        for rank in range(2)
    ]
    assert [state["stream_ids"].tolist() for state in old] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    old_mems = [torch.cat(layers, dim=1) for layers in zip(*(state["mems"] for state in old))]
    with torch.no_grad():
        stale = torch.cat([model(inputs[:8], targets[:8], old_mems)[0], model(inputs[8:], targets[8:])[0]])
    assert abs(stale.double().mean().item() - logged[11]["loss"]) > 1e-4 * logged[11]["loss"]
