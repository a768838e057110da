"""train.init_from: a run that starts from a trained model. The reference run (2 ranks, ZeRO 2) is the
pretrained model, read as each kind of source txl_dist reads: its run folder (fine-tuned at ZeRO 3 on one rank),
an export, a transformers 4.37 folder, a folder of export-to-hub, the authors' state dict. Each run's first loss
is the source model's own loss on that batch; a fine-tuned run beats one from scratch; a killed fine-tuning run
resumes from its own checkpoint, never from the model again."""

from __future__ import annotations

import json
import shutil
import signal
import sys

import pytest
import torch

from tests.launcher import (
    TRAIN,
    finish,
    in_process,
    records,
    run,
    run_streams,
    start,
    tiny_args,
    wait_for_step,
)
from txl_dist.export import load_model

pytestmark = pytest.mark.launcher

NO_DROPOUT = ("model.dropout=0", "model.dropatt=0")


@pytest.fixture(scope="module")
def sources(reference, tmp_path_factory):
    """The reference run as every kind of source: {kind: path}."""
    root = tmp_path_factory.mktemp("sources")
    export = root / "export"
    in_process("launchers/convert.py", "zero-to-export", str(reference), str(export))
    in_process("launchers/convert.py", "export-to-hf", str(export), str(root / "hf"))
    in_process("launchers/convert.py", "export-to-hub", str(export), str(root / "hub"))
    (root / "original").mkdir()
    in_process("launchers/convert.py", "export-to-original", str(export), str(root / "original" / "model.pt"))
    shutil.copyfile(export / "config.json", root / "original" / "config.json")
    return {
        "run folder": reference,
        "export": export,
        "transformers": root / "hf",
        "hub": root / "hub",
        "authors' state dict": root / "original" / "model.pt",
    }


def _first_batch_loss(model, shards, overrides: list[str], config: str = "configs/tiny_cpu.yaml") -> float:
    """The mean loss of the source model over the first step's micro-batches of a one-rank run of ``config``."""
    streams, grad_accum = run_streams(shards, overrides, config=config)
    losses = []
    with streams:
        for batch in streams:
            with torch.no_grad():
                loss, _ = model(batch.inputs, batch.targets)
            losses.append(loss.mean().item())
            if len(losses) == grad_accum:
                return sum(losses) / len(losses)
    raise AssertionError("unreachable: the streams are endless")


KIND_FLAGS = {
    # The run folder trained at ZeRO 2 on 2 ranks; this start is ZeRO 3 on one.
    "run folder": ("zero.stage=3", "zero.stage3_param_persistence_threshold=0"),
}


@pytest.mark.parametrize("kind", ["run folder", "export", "transformers", "hub", "authors' state dict"])
def test_the_first_step_is_the_source_models_own_loss(kind, sources, ptb_word_shards, tmp_path):
    output = tmp_path / "run"
    flags = [f"train.init_from={sources[kind]}", "train.max_steps=1", *NO_DROPOUT, *KIND_FLAGS.get(kind, ())]
    result = run([sys.executable, TRAIN, *tiny_args(ptb_word_shards, output, *flags)])
    first = records(output)[1]["loss"]
    source = load_model(sources["export"], dropout=0.0, dropatt=0.0)
    expected = _first_batch_loss(source, ptb_word_shards, [])
    assert first == pytest.approx(expected, rel=1e-5, abs=1e-5), result.stdout[-2000:]
    assert first < 8.5, "a trained model, not a fresh one (ln 10000 = 9.2)"
    start_record = records(output, "start")[0]
    assert start_record["init_from"]["sha256"] and start_record["init_from"]["path"] == str(sources[kind].resolve())
    recorded = json.loads((output / "init_from.json").read_text())
    assert (
        recorded["model"]["n_layer"] == source.config.n_layer
        and recorded["sha256"] == start_record["init_from"]["sha256"]
    )


def test_fine_tuning_beats_training_from_scratch_and_resumes_its_own_checkpoint(sources, ptb_word_shards, tmp_path):
    """20 steps from the export against 20 from scratch, by validation loss; then a fine-tuning run killed after
    its checkpoint of step 10 and rerun with the model gone resumes at step 10 with the run's own weights."""
    steps = ["train.max_steps=20", "checkpoint.every=10"]
    tuned, scratch = tmp_path / "tuned", tmp_path / "scratch"
    run([sys.executable, TRAIN, *tiny_args(ptb_word_shards, tuned, *steps, f"train.init_from={sources['export']}")])
    run([sys.executable, TRAIN, *tiny_args(ptb_word_shards, scratch, *steps)])
    tuned_eval, scratch_eval = records(tuned, "eval")[20]["loss"], records(scratch, "eval")[20]["loss"]
    assert tuned_eval < scratch_eval - 0.2, (tuned_eval, scratch_eval)

    model = shutil.copytree(sources["export"], tmp_path / "model")
    killed = tmp_path / "killed"
    args = tiny_args(ptb_word_shards, killed, "train.max_steps=40", "checkpoint.every=10", f"train.init_from={model}")
    process = start([sys.executable, TRAIN, *args])
    wait_for_step(killed, 12, process)
    process.send_signal(signal.SIGKILL)
    finish(process)
    shutil.rmtree(model)  # a resume must not need the model: the run has its own weights
    result = run([sys.executable, TRAIN, *args])
    assert "not read, the run resumes from its own step00000010" in result.stdout + result.stderr
    starts = records(killed, "start")
    assert sorted(starts) == [0, 10] and starts[10]["init_from"]["path"] == str(model.resolve())
    assert max(records(killed)) == 40
