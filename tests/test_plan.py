"""txl_dist.plan: the activation counts against the tensors the model really saves and the peak it really
reaches (PyTorch's profiler, one process), the model-state arithmetic per ZeRO stage, the largest micro-batch,
and the command line. The plan against whole 2-rank runs is benchmarks/plan_check.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from txl_dist import plan
from txl_dist.config import load_config, with_manifest_vocab
from txl_dist.config.model import preset
from txl_dist.model import TransformerXLLM

REPO = Path(__file__).resolve().parents[1]
# Sizes that no two shape classes of the formula share (K B h != L B d_inner, ...).
SHAPE = dict(
    d_model=48,
    n_head=2,
    d_head=20,
    d_inner=112,
    d_embed=64,
    n_token=5000,
    cutoffs=[1000, 2000, 3000],
    tgt_len=5,
    mem_len=7,
)
BATCH = 3


def _batch(model, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and Zipf-like targets, most in the head cluster and at least one in every tail cluster."""
    generator = torch.Generator().manual_seed(seed)
    ranks = (torch.rand(batch, model.tgt_len, generator=generator) ** -1.5).long().clamp(max=model.n_token - 1)
    for cluster, (start, end) in enumerate(model.cluster_bounds()[1:]):
        ranks[cluster % batch, 1 + cluster // batch] = (start + end) // 2
    return ranks.roll(1, 1), ranks


def _saved_bytes(model_config, dtype: torch.dtype, batch: int) -> tuple[int, list[int]]:
    """Bytes of the distinct non-parameter storages the model saves for backward, and the targets' rows per
    tail cluster."""
    torch.manual_seed(0)
    model = TransformerXLLM(model_config).to(dtype).train()
    tokens, targets = _batch(model_config, batch)
    mems = [
        torch.randn(model_config.mem_len, batch, model_config.d_model).to(dtype)
        for _ in range(model_config.n_layer + 1)
    ]
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, targets, mems)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    rows = [int(((targets >= start) & (targets < end)).sum()) for start, end in model_config.cluster_bounds()[1:]]
    return sum(size for pointer, size in seen.items() if pointer not in parameters), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_and_head_activations_count_the_saved_tensors(dtype, dropout):
    config = {**SHAPE, "dropout": dropout, "dropatt": dropout}
    one, rows = _saved_bytes(preset("lm1b_base", n_layer=1, **config), dtype, BATCH)
    three, rows_again = _saved_bytes(preset("lm1b_base", n_layer=3, **config), dtype, BATCH)
    assert rows == rows_again and min(rows) > 0
    model = preset("lm1b_base", n_layer=1, **config)
    b = dtype.itemsize
    per_layer = (three - one) / 2
    assert plan.layer_activation_bytes(model, BATCH, b) == pytest.approx(per_layer, rel=0.05)
    head = plan.head_activation_bytes(model, BATCH, b, rows=rows)
    assert head == pytest.approx(one - per_layer, rel=0.10)


def test_forward_backward_peak_is_the_plan_within_a_fifth():
    """The peak of live tensor bytes of a forward and backward pass (profiled) against the plan's activations
    and transient, for a model big enough that the head's logits matter. (The peak comes at the start of the
    backward pass, before most gradients exist.)"""
    from torch.profiler import ProfilerActivity, profile

    model_config = preset(
        "lm1b_base",
        n_layer=2,
        d_model=128,
        n_head=4,
        d_head=32,
        d_inner=512,
        n_token=30000,
        cutoffs=[5000, 10000, 20000],
        tgt_len=16,
        mem_len=16,
    )
    batch = 8
    torch.manual_seed(0)
    model = TransformerXLLM(model_config).to(torch.bfloat16).train()
    tokens, targets = _batch(model_config, batch)
    mems = [torch.randn(16, batch, 128).to(torch.bfloat16) for _ in range(3)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        loss, _ = model(tokens, targets, mems)
        loss.mean().backward()
    live = peak = 0
    for _, size in sorted(
        (e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"
    ):
        live += size
        peak = max(peak, live)
    rows = [int(((targets >= s) & (targets < e)).sum()) for s, e in model_config.cluster_bounds()[1:]]
    planned = (
        2 * plan.layer_activation_bytes(model_config, batch, 2)
        + plan.head_activation_bytes(model_config, batch, 2, rows=rows)
        + plan.head_transient_bytes(model_config, batch, 2)
    )
    assert planned == pytest.approx(peak, rel=0.2)


def test_model_states_follow_the_zero_stage():
    cfg = with_manifest_vocab(load_config(REPO / "configs" / "lm1b_base.yaml"), 793_471, "test")
    shape = plan.ModelShape.of(cfg.model)
    assert shape.parameters == 357_812_082  # the preset's documented size
    P = shape.parameters

    def terms(stage: int, dtype: str = "bf16", offload: str = "none", world: int = 8) -> dict[str, plan.Term]:
        changed = load_config(
            REPO / "configs" / "lm1b_base.yaml",
            [f"zero.stage={stage}", f"precision.dtype={dtype}", f"zero.offload_optimizer={offload}"],
        )
        changed = with_manifest_vocab(changed, 793_471, "test")
        return {t.name: t for t in plan.plan_memory(changed, world, 1, "cuda", shape).terms}

    zero2 = terms(2)
    assert zero2["parameters"].bytes == 2 * P
    assert zero2["fp32 master weights"].bytes == 4 * -(-P // 8)
    assert zero2["Adam moments (fp32)"].bytes == 8 * -(-P // 8)
    assert zero2["reduction bucket"].bytes == 2 * 200_000_000  # allocated whole on a GPU
    zero3 = terms(3)
    assert zero3["parameter partition"].bytes == 2 * -(-P // 8)
    zero0_fp32 = terms(0, "fp32")
    assert "fp32 master weights" not in zero0_fp32 and zero0_fp32["Adam moments (fp32)"].bytes == 8 * P
    offloaded = terms(2, offload="cpu")
    assert offloaded["Adam moments (fp32)"].where == "host" and offloaded["fp32 master weights"].where == "host"
    on_device = plan.plan_memory(
        with_manifest_vocab(load_config(REPO / "configs" / "lm1b_base.yaml"), 793_471, "t"), 8, 1, "cuda", shape
    )
    offload_plan = plan.plan_memory(
        with_manifest_vocab(
            load_config(REPO / "configs" / "lm1b_base.yaml", ["zero.offload_optimizer=cpu"]), 793_471, "t"
        ),
        8,
        1,
        "cuda",
        shape,
    )
    assert offload_plan.peak < on_device.peak and offload_plan.host >= 12 * -(-P // 8)


def test_largest_micro_batch_fits_and_the_next_does_not():
    cfg = with_manifest_vocab(load_config(REPO / "configs" / "lm1b_large.yaml"), 793_471, "test")
    shape = plan.ModelShape.of(cfg.model)
    fit = plan.largest_micro_batch(cfg, 64, 80 * plan.GiB, "cuda", shape)
    assert fit.largest_any > 8
    assert plan.plan_memory(cfg, 64, fit.largest_any, "cuda", shape).needed() <= 80 * plan.GiB
    assert plan.plan_memory(cfg, 64, fit.largest_any + 1, "cuda", shape).needed() > 80 * plan.GiB
    assert fit.micro_batch == 8 and fit.grad_accum == 1  # global batch 512 on 64 ranks: at most 8 per rank
    small = plan.largest_micro_batch(cfg, 64, 6 * plan.GiB, "cuda", shape)
    assert small.micro_batch is not None and 512 % (64 * small.micro_batch) == 0
    assert small.micro_batch * small.grad_accum == 8
    assert plan.largest_micro_batch(cfg, 2, 4 * plan.GiB, "cuda", shape).largest_any == 0


def test_sizes_parse():
    assert plan.parse_size("80GiB") == 80 * 2**30 and plan.parse_size("80GB") == 80 * 10**9
    assert plan.parse_size("24G") == 24 * 10**9 and plan.parse_size("1.5TiB") == int(1.5 * 2**40)
    with pytest.raises(ValueError, match="not a memory size"):
        plan.parse_size("lots")


def test_command_line_plans_lm1b_large_without_deepspeed():
    program = (
        "import sys; from txl_dist import plan; plan.main(['--config', 'configs/lm1b_large.yaml', "
        "'--world-size', '64', '--device-memory', '80GiB']); "
        "print('deepspeed imported:', 'deepspeed' in sys.modules)"
    )
    completed = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert "841,295,982 parameters" in out and "64 rank(s) of cuda" in out
    assert "largest micro-batch that fits:" in out and "train.micro_batch=8 x 1 accumulation" in out
    assert out.strip().endswith("deepspeed imported: False")
    bad = subprocess.run(
        [sys.executable, "-m", "txl_dist.plan", "--config", "configs/lm1b_large.yaml", "--world-size", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--world-size 0: must be at least 1" in bad.stderr


def test_print_config_shows_the_plan_as_comments(capsys):
    from txl_dist.training.startup import parse_run_args

    with pytest.raises(SystemExit):
        parse_run_args(
            ["--config", str(REPO / "configs" / "lm1b_large.yaml"), "--print-config"], world_size=64, device="cuda"
        )
    out = capsys.readouterr().out
    comments = [line for line in out.splitlines() if line.startswith("# ")]
    assert comments[0].startswith("# memory plan: lm1b_large") and any("peak per rank" in c for c in comments)


# --- the planner's vocabulary ---------------------------------------------------------------------------------------


def _plan(capsys, *args: str, world: tuple[str, ...] = ("--world-size", "2")) -> tuple[int, str, str]:
    base = ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), *world, "--device", "cpu"]
    try:
        status = plan.main([*base, *args])
    except SystemExit as exited:
        status = exited.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_planner_refuses_a_vocab_size_that_disagrees_with_the_manifest(capsys, ptb_word_shards):
    status, out, err = _plan(capsys, "--vocab-size", "5000", f"data.shards={ptb_word_shards}")
    assert status == 2 and out == ""
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            f"error: --vocab-size 5000 disagrees with the manifest {ptb_word_shards / 'manifest.json'}: vocab_size "
            f"10000; leave --vocab-size out to take it from the manifest"
        )
    )
    for agreeing in (["--vocab-size", "10000"], []):
        status, out, _ = _plan(capsys, *agreeing, f"data.shards={ptb_word_shards}")
        assert status == 0 and "n_token 10,000)" in out


def test_the_planner_refuses_data_shards_without_a_manifest(capsys, tmp_path):
    status, out, err = _plan(capsys, "--vocab-size", "5000", f"data.shards={tmp_path}")
    assert status == 2 and out == ""
    assert f"{tmp_path / 'manifest.json'}: no manifest" in err.strip().splitlines()[-1]
    status, out, _ = _plan(capsys, "--vocab-size", "5000")
    assert status == 0 and "n_token 5,000)" in out


def test_a_micro_batch_that_no_world_size_can_hold_is_refused_saying_why(capsys):
    """Above the global batch, or not one of its divisors: said so, naming both numbers (no empty list of world
    sizes)."""
    for micro_batch, why in ((1000, "is larger than the global batch 8"), (3, "does not divide the global batch 8")):
        status, out, err = _plan(capsys, "--micro-batch", str(micro_batch))
        assert status == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.strip().endswith(
            f"error: --micro-batch {micro_batch} with train.global_batch=8: no world size can hold it: the "
            f"micro-batch {micro_batch} {why}; the micro-batches that divide it: 1, 2, 4, 8"
        ), err
    status, out, _ = _plan(capsys, "--micro-batch", "8", world=("--world-size", "1"))
    assert status == 0 and "micro-batch 8" in out


# --- the planner's world from a hostfile ----------------------------------------------------------------------------


def test_the_planner_takes_its_world_from_a_hostfile(capsys, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=3 max_slots=4\nnode2 slots=1\n")
    status, out, _ = _plan(capsys, "--hostfile", str(hostfile), world=())
    assert status == 0 and "4 rank(s) of cpu" in out


@pytest.mark.parametrize(
    "text, message",
    [
        ("node1 slots=2\nnode1 slots=2\n", ":2: node1 is listed again (first on line 1)"),
        ("node1 slots=two\n", ":1: 'node1 slots=two' is not `HOST slots=N`"),
        ("node1 slots=0\n", ":1: node1 has slots=0: a host needs at least one slot"),
    ],
)
def test_the_planner_refuses_a_hostfile_that_deepspeeds_runner_mishandles(capsys, tmp_path, text, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    status, out, err = _plan(capsys, "--hostfile", str(hostfile), world=())
    assert status == 2 and out == ""
    last = err.strip().splitlines()[-1]
    assert f"error: {hostfile}{message}" in last


def test_the_planner_wants_one_of_world_size_and_hostfile(capsys, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=2\n")
    status, _, err = _plan(capsys, "--hostfile", str(hostfile), "--world-size", "2", world=())
    assert status == 2 and "not allowed with argument" in err
    status, _, err = _plan(capsys, world=())
    assert status == 2 and "one of the arguments --world-size --hostfile is required" in err
