"""A model of the lm1b shape, scaled down, trained on 2 CPU ranks with ZeRO-3 whose parameters really are
partitioned: adaptive input and softmax with div_val 4, three cutoffs and untied projections over a vocabulary
of 108k words (a synthetic corpus with One Billion Word's layout), so that every tail cluster is real. It
resumes exactly, and its export equals the parameters gathered from the live engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.corpora import synthetic_lm1b
from data_tools import build_shards, train_tokenizer
from tests.launcher import copy_at_step, in_process, records, run, torchrun_command

pytestmark = pytest.mark.launcher

STEPS = 12  # 6 before the resume, 6 after
CUTOFFS = [2000, 10000, 60000]


@pytest.fixture(scope="module")
def lm1b_like(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer, shards) of a synthetic corpus of 1.5M words whose word law is flatter than One Billion Word's
    (exponent 1.25 over 400k ranks): 108k words seen, 3% of the tokens beyond rank 60,000."""
    root = tmp_path_factory.mktemp("lm1b_like")
    shape = synthetic_lm1b.CorpusShape(scale=0.002, exponent=1.25, vocabulary=400_000)
    synthetic_lm1b.write_corpus(root, shape, progress=False)
    source = root / synthetic_lm1b.ROOT_NAME
    tokenizer, shards = root / "tokenizer", root / "shards"
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "word",
                "--format",
                "lm1b",
                "--input",
                str(source),
                "--output",
                str(tokenizer),
                "--specials",
                "<S>",
                "</S>",
                "--eos",
                "</S>",
                "--unk",
                "<UNK>",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        build_shards.main(
            [
                "--tokenizer",
                str(tokenizer),
                "--output",
                str(shards),
                "--format",
                "lm1b",
                "--input",
                str(source),
                "--no-progress",
            ]
        )
        == 0
    )
    return tokenizer, shards


def lm1b_args(shards: Path, output: Path, *extra: str) -> list[str]:
    """lm1b_base's head (div_val 4, untied projections) with tiny layers, ZeRO-3 with every parameter
    partitioned, dropout on (so that resuming must restore the RNG too)."""
    return [
        "--config",
        "configs/tiny_cpu.yaml",
        "--config",
        "configs/variants/zero3.yaml",
        "zero.stage3_param_persistence_threshold=0",
        f"data.shards={shards}",
        f"train.output_dir={output}",
        "model.preset=lm1b_base",
        "model.n_layer=2",
        "model.n_head=2",
        "model.d_head=8",
        "model.d_model=16",
        "model.d_inner=32",
        "model.d_embed=64",
        f"model.cutoffs={json.dumps(CUTOFFS)}",
        "model.tgt_len=16",
        "model.mem_len=16",
        "model.dropout=0.1",
        "train.global_batch=8",
        "train.micro_batch=2",
        "optim.lr=5e-3",
        "schedule.warmup_steps=2",
        f"schedule.total_steps={STEPS}",
        "log.every=1",
        "eval.every=0",
        "checkpoint.every=6",
        "checkpoint.keep_last=0",
        *extra,
    ]


def test_lm1b_shape_on_zero3_resumes_exactly_and_exports_the_live_parameters(lm1b_like, tmp_path):
    tokenizer, shards = lm1b_like
    straight = tmp_path / "straight"
    run(torchrun_command("launchers/train.py", lm1b_args(shards, straight, f"train.max_steps={STEPS}")))
    resumed = copy_at_step(straight, STEPS // 2, tmp_path / "resumed")
    live = tmp_path / "live.pt"
    result = run(
        torchrun_command(
            "tests/scripts/train_and_gather.py",
            [str(live), *lm1b_args(shards, resumed, f"train.max_steps={STEPS}", f"data.tokenizer={tokenizer}")],
        )
    )
    assert f"at step {STEPS // 2} (exact" in result.stdout + result.stderr

    # Exact resume: every step after the resume has the straight run's data and loss.
    reference, continued = records(straight), records(resumed)
    assert sorted(continued) == list(range(1, STEPS + 1))
    for step in range(STEPS // 2 + 1, STEPS + 1):
        assert continued[step]["data_checksum"] == reference[step]["data_checksum"], step
        assert continued[step]["loss"] == reference[step]["loss"], step

    # The parameters really were partitioned: none kept whole, rank 0 holds half of each (rounded up).
    partitions = json.loads(Path(f"{live}.zero3.json").read_text())
    assert len(partitions) > 20
    for name, partition in partitions.items():
        assert not partition["persist"], name
        assert partition["local_numel"] == -(-partition["numel"] // 2), name

    # The export of the last checkpoint equals the live parameters, the adaptive head's clusters included.
    export = tmp_path / "export"
    in_process("launchers/convert.py", "zero-to-export", str(resumed), str(export))
    from txl_dist.export import load_model

    model = load_model(export)
    config = model.config
    assert config.n_token > 100_000 and config.cutoffs == CUTOFFS and config.div_val == 4
    assert config.tie_projs_resolved == [False] * 4 and config.cluster_dims() == [64, 16, 4, 1]
    gathered = torch.load(live, weights_only=True)
    state = model.state_dict()
    assert sorted(gathered) == sorted(name for name, _ in model.named_parameters())
    assert {f"crit.out_projs.{i}" for i in range(4)} <= set(gathered)
    for name, tensor in gathered.items():
        assert torch.equal(state[name], tensor), name
