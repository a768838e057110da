"""One check of the CUDA paths on one NVIDIA GPU, in a few minutes, ending with one JSON line.

    make gpu-check                                  # all sections (under 8 minutes on one H200)
    python benchmarks/gpu_check.py --sections attention,host_syncs --out /tmp/gpu_check

Sections, each in its own process (a CUDA error in one cannot poison the next) with its own time limit:

- ``cuda_tests``: the test suite's CUDA-only tests (``pytest -m cuda``): fp16 with dynamic loss scaling, bf16,
  NCCL on one GPU, the efficient attention kernel.
- ``attention``: fused against reference attention at lm1b_base's shape, forward and gradients, in fp32, bf16 and
  fp16, with ``scaled_dot_product_attention`` restricted to the memory-efficient kernel, plus the time of each.
- ``host_syncs``: host synchronisations in one training step (``torch.cuda.set_sync_debug_mode``), of the model
  with torch's fused AdamW, and of a DeepSpeed engine step; each sync is attributed to a source line.
- ``model_step``: `benchmarks/model_step.py` on lm1b_base in bf16 (tokens/s, max allocated memory).
- ``train_throughput``: real 1-GPU runs of launchers/train.py through the deepspeed launcher: ptb_small (bf16 and
  fp16) on the Penn Treebank and lm1b_base (bf16) on synthetic shards with its 793k-word vocabulary.
- ``eval_speed``: `benchmarks/eval_speed.py` on CUDA (evaluation with the memory, generation with the cache).
- ``compile``: model.compile (TorchInductor) against eager on lm1b_base-shaped layers in bf16, compile time apart.
- ``oom_snapshot``: the training loop's out-of-memory hook (`txl_dist.training.profiling`) on a real CUDA
  out-of-memory error, with allocation history recorded: the snapshot file it writes, read back.

On a machine without CUDA it says so in one line and exits 0, so CI may call it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = (
    "cuda_tests",
    "attention",
    "host_syncs",
    "train_throughput",
    "model_step",
    "eval_speed",
    "compile",
    "oom_snapshot",
)
# Seconds each section may take before it is stopped (the whole check must stay under 8 minutes).
LIMITS = {
    "cuda_tests": 120,
    "attention": 45,
    "host_syncs": 60,
    "model_step": 75,
    "train_throughput": 170,
    "eval_speed": 50,
    "compile": 120,
    "oom_snapshot": 30,
}


def _last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


# ---- attention --------------------------------------------------------------------------------------------------


def section_attention(args: argparse.Namespace) -> dict:
    import torch
    from torch.nn.attention import SDPBackend

    case = _AttentionCase()
    results: dict = {"shape": case.shape}
    oracle_out, oracle_grads = case.run("reference", None, None)
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        row: dict = {}
        for impl, kernel in (("reference", None), ("fused", SDPBackend.EFFICIENT_ATTENTION), ("fused_any", None)):
            impl_name = "fused" if impl.startswith("fused") else impl
            try:
                out, grads = case.run(impl_name, dtype, kernel)
            except RuntimeError as error:
                row[impl] = {"error": str(error).splitlines()[0][:300]}
                continue
            row[impl] = {
                "output_rel_err_vs_fp32_reference": _rel_err(out, oracle_out),
                "max_grad_rel_err_vs_fp32_reference": max(_rel_err(grads[k], oracle_grads[k]) for k in oracle_grads),
                "fwd_bwd_ms": case.timed(impl_name, dtype, kernel),
            }
        results[name] = row
    # Which kernel the fused path picks on its own under bf16 (profiler kernel names).
    try:
        results["bf16_attention_kernels"] = case.bf16_kernels()
    except Exception as error:  # the profiler is a diagnostic only
        results["bf16_attention_kernels"] = f"profiler failed: {error}"
    return results


def _rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class _AttentionCase:
    """One attention layer at lm1b_base's shape on the GPU, random weights and inputs, run in any precision."""

    def __init__(self):
        import torch

        from txl_dist.model.attention import (
            RelPartialLearnableMultiHeadAttn,
            attention_mask,
            relative_positions,
            sinusoid_encoding,
        )

        device = torch.device("cuda")
        n_head, d_head, d_model, qlen, mlen, bsz = 8, 128, 1024, 128, 128, 16
        self.shape = {"n_head": n_head, "d_head": d_head, "d_model": d_model, "qlen": qlen, "mlen": mlen, "batch": bsz}
        torch.manual_seed(0)
        self.layer = RelPartialLearnableMultiHeadAttn(
            n_head,
            d_model,
            d_head,
            dropout=0.0,
            dropatt=0.0,
            pre_lnorm=False,
            layer_norm_eps=1e-5,
            attn_impl="reference",
            own_position_biases=True,
        ).to(device)
        with torch.no_grad():
            for p in self.layer.parameters():
                p.normal_(0.0, 0.05)
            self.layer.layer_norm.weight.fill_(1.0)
        self.w0 = torch.randn(qlen, bsz, d_model, device=device)
        self.mem0 = torch.randn(mlen, bsz, d_model, device=device)
        self.mask = attention_mask(qlen, mlen, mlen, False, device)
        self.r0 = sinusoid_encoding(relative_positions(mlen + qlen, -1, device), d_model)

    def run(self, impl: str, dtype, kernel):
        """Output and gradients (fp32) of one forward and backward with ``impl``, autocast to ``dtype``."""
        import torch
        from torch.nn.attention import sdpa_kernel

        layer = self.layer
        layer.attn_impl = impl
        layer.zero_grad(set_to_none=True)
        w = self.w0.clone().requires_grad_(True)
        mem = self.mem0.clone()
        ctx = sdpa_kernel(kernel) if kernel is not None else torch.autocast("cuda", enabled=False)
        with ctx, torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = layer(w, self.r0, self.mask, mem)
        # A static loss scale, as fp16 training applies a dynamic one: unscaled, small fp16 gradients underflow.
        scale = 1024.0 if dtype == torch.float16 else 1.0
        (out.float().pow(2).mean() * scale).backward()
        grads = {name: p.grad.detach().float() / scale for name, p in layer.named_parameters()}
        grads["input"] = w.grad.detach().float() / scale
        return out.detach().float(), grads

    def timed(self, impl: str, dtype, kernel, repeats: int = 20) -> float:
        """Milliseconds of one forward and backward, after 3 untimed ones."""
        import torch

        for _ in range(3):
            self.run(impl, dtype, kernel)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            self.run(impl, dtype, kernel)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats * 1e3

    def bf16_kernels(self) -> list[str]:
        """The attention kernels the profiler sees the fused path launch under bf16 autocast."""
        import torch
        from torch.profiler import ProfilerActivity, profile

        self.layer.attn_impl = "fused"
        with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.autocast("cuda", dtype=torch.bfloat16):
            self.layer(self.w0, self.r0, self.mask, self.mem0).float().sum().backward()
        names = {e.key for e in prof.key_averages()}
        return sorted(
            n for n in names if any(s in n.lower() for s in ("fmha", "flash", "attention", "efficient", "cudnn"))
        )[:10]


# ---- host syncs -------------------------------------------------------------------------------------------------


def _count_syncs(step) -> dict:
    """Run ``step()`` once under torch.cuda.set_sync_debug_mode('warn'); count the syncs by source line."""
    import warnings

    import torch

    where: dict[str, int] = {}
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        if (
            frames
            and frames[-1].filename.endswith("torch/cuda/__init__.py")
            and "sync_debug_mode" in (frames[-1].line or "")
        ):
            return  # switching the mode itself
        ours = [f for f in frames if "/txl_dist/" in f.filename or "/deepspeed/" in f.filename]
        frame = (ours or frames)[-1]
        key = f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} {frame.line}"
        where[key] = where.get(key, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
    torch.cuda.synchronize()
    return {"syncs": sum(where.values()), "where": where}


def section_host_syncs(args: argparse.Namespace) -> dict:
    import torch

    from txl_dist.evaluation import to_device
    from txl_dist.model import TransformerXLLM, preset

    device = torch.device("cuda")
    config = preset("lm1b_base", n_layer=2, d_model=256, n_head=4, d_head=64, d_inner=1024, d_embed=256)
    torch.manual_seed(0)
    results: dict = {}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        model = TransformerXLLM(config).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        data = torch.randint(0, config.n_token, (8, 8 * config.tgt_len + 1))
        state = {"mems": None, "i": 0}

        # as the trainer does it: host-side target plan, pinned batches copied with non_blocking
        def step(model=model, optimizer=optimizer, data=data, state=state, dtype=dtype):
            i = state["i"]
            window = data[:, i * config.tgt_len : (i + 1) * config.tgt_len + 1]
            rows = model.cluster_rows(window[:, 1:], device)
            inputs, targets = to_device(window[:, :-1], device), to_device(window[:, 1:], device)
            with torch.autocast("cuda", dtype=dtype):
                loss, state["mems"] = model(inputs, targets, state["mems"], cluster_rows=rows)
            loss.float().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state["i"] += 1

        for _ in range(2):
            step()
        results[f"model_{dtype_name}"] = _count_syncs(step)
    try:
        results["deepspeed_engine_bf16"] = _engine_syncs()
    except Exception as error:
        results["deepspeed_engine_bf16"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return results


def _engine_syncs() -> dict:
    """Host syncs of one step of the trainer's DeepSpeed engine (ZeRO-2, bf16) on one process."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    import deepspeed
    import torch

    from txl_dist.config import OptimConfig, PrecisionConfig, TrainConfig, ZeroConfig
    from txl_dist.evaluation import to_device
    from txl_dist.model import TransformerXLLM, preset
    from txl_dist.training.deepspeed_config import build_deepspeed_config, build_torch_optimizer

    deepspeed.init_distributed()
    config = preset("lm1b_base", n_layer=2, d_model=256, n_head=4, d_head=64, d_inner=1024, d_embed=256)
    model = TransformerXLLM(config)
    ds_config = build_deepspeed_config(
        train=TrainConfig(global_batch=8),
        optim=OptimConfig(),
        precision=PrecisionConfig(dtype="bf16"),
        zero=ZeroConfig(stage=2),
        world_size=1,
        device="cuda",
        num_parameters=model.num_parameters(),
    )
    optimizer = build_torch_optimizer(OptimConfig(), model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=ds_config
    )
    data = torch.randint(0, config.n_token, (8, 8 * config.tgt_len + 1))
    state = {"mems": None, "i": 0}
    device = torch.device("cuda")

    def step():  # Trainer._forward's recipe, then DeepSpeed's backward and step
        i = state["i"]
        window = data[:, i * config.tgt_len : (i + 1) * config.tgt_len + 1]
        rows = engine.module.cluster_rows(window[:, 1:], device)
        loss, state["mems"] = engine(
            to_device(window[:, :-1], device), to_device(window[:, 1:], device), state["mems"], cluster_rows=rows
        )
        engine.backward(loss.mean())
        engine.step()
        state["i"] += 1

    for _ in range(2):
        step()
    return _count_syncs(step)


# ---- model step, eval speed -------------------------------------------------------------------------------------


def _run_script(command: list[str], limit: float) -> dict:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=limit)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stderr[-1500:]}")
    return _last_json(result.stdout)


def section_model_step(args: argparse.Namespace) -> dict:
    return _run_script(
        [
            sys.executable,
            "benchmarks/model_step.py",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--configs",
            "lm1b_base",
            "--batch",
            "64",
            "--steps",
            "10",
            "--warmup",
            "3",
            "--repeats",
            "2",
        ],
        LIMITS["model_step"] - 5,
    )


def section_compile(args: argparse.Namespace) -> dict:
    return _run_script(
        [
            sys.executable,
            "benchmarks/model_step.py",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--configs",
            "lm1b_base",
            "--impls",
            "fused,fused+compile",
            "--batch",
            "64",
            "--steps",
            "10",
            "--warmup",
            "4",
            "--repeats",
            "1",
        ],
        LIMITS["compile"] - 5,
    )


def section_eval_speed(args: argparse.Namespace) -> dict:
    return _run_script(
        [
            sys.executable,
            "benchmarks/eval_speed.py",
            "--device",
            "cuda",
            "--preset",
            "lm1b_base",
            "--lengths",
            "128,640",
            "--batch",
            "8",
            "--repeats",
            "2",
        ],
        LIMITS["eval_speed"] - 5,
    )


# ---- tests, training runs ---------------------------------------------------------------------------------------


def section_cuda_tests(args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-m",
        "cuda",
        "tests",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
    ]
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=LIMITS["cuda_tests"] - 5
    )
    lines = result.stdout.strip().splitlines()
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {
        "returncode": result.returncode,
        "summary": lines[-1] if lines else "",
        "failures": failures,
        "tail": "\n".join(lines[-40:]) if result.returncode else "",
    }


def section_oom_snapshot(args: argparse.Namespace) -> dict:
    """A real CUDA out-of-memory error inside `out_of_memory_snapshot` (this process limited to 2% of the device),
    with allocation history on, as profile.memory_history=true records it: the one-line error and the snapshot."""
    import pickle

    import torch

    from txl_dist.config import ProfileConfig
    from txl_dist.training.profiling import OutOfDeviceMemory, out_of_memory_snapshot, start_memory_history

    device = torch.device("cuda", 0)
    torch.cuda.set_per_process_memory_fraction(0.02, 0)
    start_memory_history(ProfileConfig(memory_history=True), device)
    out = Path(tempfile.mkdtemp(prefix="oom_snapshot."))
    blocks, message = [], ""
    try:
        with out_of_memory_snapshot(out, 0, device, lambda: 6):
            while True:
                blocks.append(torch.empty(256 * 2**20, dtype=torch.uint8, device=device))
    except OutOfDeviceMemory as error:
        message = str(error)
    allocated = len(blocks) * 256
    blocks.clear()
    path = out / "memory_snapshot_rank_0_step_7.pickle"
    oom_snapshot_problems(message, path, raise_them=True)
    snapshot = pickle.loads(path.read_bytes())  # our own file, written just now
    traces = snapshot.get("device_traces", [[]])
    return {
        "message": message,
        "one_line": True,
        "allocated_before_oom_mib": allocated,
        "snapshot_bytes": path.stat().st_size,
        "segments": len(snapshot.get("segments", [])),
        "trace_entries": len(traces[0]) if traces else 0,
    }


def oom_snapshot_problems(message: str, path: Path, raise_them: bool = False) -> list[str]:
    """What the out-of-memory hook got wrong (docs/profiling.md, "Out of device memory"): an error message that is
    empty, longer than one line or does not name the snapshot; a snapshot file missing or empty. With
    ``raise_them``, a RuntimeError naming every problem, so the section fails instead of passing on its figures."""
    problems = []
    if not message.strip():
        problems.append("no out-of-memory error message")
    elif len(message.splitlines()) != 1 or message.endswith(("\n", "\r")):
        problems.append(f"the error message is more than one line: {message!r}")
    if message.strip() and str(path) not in message:
        problems.append(f"the error message does not name the snapshot {path}: {message!r}")
    if not path.is_file():
        problems.append(f"no snapshot written at {path}")
    elif path.stat().st_size == 0:
        problems.append(f"the snapshot {path} is empty (0 bytes)")
    if problems and raise_them:
        raise RuntimeError("oom_snapshot: " + "; ".join(problems))
    return problems


def _synthetic_lm1b_shards(directory: Path, vocab_size: int, tokens: int) -> Path:
    """Shards of Zipf-distributed token ids over lm1b's vocabulary (throughput only; no tokenizer)."""
    import numpy as np

    from data_tools.shards.writer import ShardWriter
    from txl_dist.data.format import Manifest, SplitEntry, TokenizerIdentity, token_dtype, write_manifest

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    dtype = token_dtype(vocab_size)
    splits = {}
    for split, count in (("train", tokens), ("valid", 20_000)):
        writer = ShardWriter(directory, split, vocab_size, dtype, 1 << 20)
        ids = (rng.zipf(1.2, size=count) - 1) % vocab_size
        for start in range(0, count, 65536):
            block = ids[start : start + 65536]
            writer.add_block(block, np.array([0]))
        shards = writer.close()
        splits[split] = SplitEntry(
            documents=sum(s.documents for s in shards),
            tokens=count,
            blocks=sum(s.blocks for s in shards),
            shards=shards,
        )
    identity = TokenizerIdentity(kind="synthetic", vocab_size=vocab_size, fingerprint="0" * 64, eos_id=0, eod_id=0)
    write_manifest(directory, Manifest(tokenizer=identity, dtype=dtype.name, block_tokens=65536, splits=splits))
    return directory


def _train(config: str, shards: Path, output: Path, overrides: list[str], limit: float) -> dict:
    beside = Path(sys.executable).parent / "deepspeed"
    launcher = [str(beside)] if beside.exists() else [shutil.which("deepspeed") or "deepspeed"]
    command = [
        *launcher,
        "--num_gpus",
        "1",
        "--master_port",
        "29541",
        "launchers/train.py",
        "--config",
        config,
        f"data.shards={shards}",
        f"train.output_dir={output}",
        "eval.every=0",
        "checkpoint.every=0",
        "log.tensorboard=false",
        "schedule.warmup_steps=1",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
    if result.returncode != 0:
        raise RuntimeError(f"exited {result.returncode}: {(result.stdout + result.stderr)[-2000:]}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    windows = train[1:] or train
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in windows),
        "step_time_ms": statistics.median(r["step_time_s"] for r in windows) * 1e3,
        "max_allocated_mb": max(r.get("max_allocated_mb", 0.0) for r in train),
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "skipped_steps": train[-1].get("skipped_steps"),
        "loss_scale": train[-1].get("loss_scale"),
        "wall_s": time.perf_counter() - start,
    }


def section_train_throughput(args: argparse.Namespace) -> dict:
    from data_tools import build_shards, train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="gpu_check."))
    results: dict = {}
    tokenizer, shards = work / "ptb_tokenizer", work / "ptb_shards"
    train_tokenizer.main(["--kind", "word", "--format", "ptb", "--output", str(tokenizer), "--no-progress"])
    build_shards.main(["--tokenizer", str(tokenizer), "--output", str(shards), "--format", "ptb", "--no-progress"])
    runs = [
        (
            "ptb_small_bf16",
            "configs/ptb_small.yaml",
            shards,
            ["precision.dtype=bf16", "train.max_steps=300", "log.every=50"],
        ),
        (
            "ptb_small_fp16",
            "configs/ptb_small.yaml",
            shards,
            ["precision.dtype=fp16", "train.max_steps=300", "log.every=50"],
        ),
    ]
    lm1b = work / "lm1b_shards"
    _synthetic_lm1b_shards(lm1b, 793471, 4_000_000)
    runs.append(
        (
            "lm1b_base_bf16",
            "configs/lm1b_base.yaml",
            lm1b,
            ["train.max_steps=40", "log.every=10", "train.global_batch=224"],
        )
    )
    for name, config, data, overrides in runs:
        try:
            results[name] = _train(config, data, work / name, [*args.train_overrides, *overrides], 110)
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {str(error)[-1500:]}"}
        print(name, json.dumps(results[name]), flush=True)
    return results


# ---- driver -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--out", help="also write the figures to OUT/gpu_check.json and each section's log")
    parser.add_argument("--train-overrides", nargs="*", default=[], help="extra key=value for the training runs")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # one section, in its own process
    args = parser.parse_args(argv)

    import torch

    if args.section:
        result = globals()[f"section_{args.section}"](args)
        print(json.dumps(result))
        return 0
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "message": "no CUDA device: nothing to check"}))
        return 0
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    figures: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "sections": {},
    }
    failed = []
    for section in sections:
        value, log = _run_section(section, args.train_overrides)
        if "error" in value or value.get("returncode", 0) != 0:
            failed.append(section)
        figures["sections"][section] = value
        print(f"== {section} ({value['seconds']} s)\n{json.dumps(value, indent=1)[:6000]}", flush=True)
        if out:
            (out / f"{section}.log").write_text(log or "", encoding="utf-8")
    figures["failed"] = failed
    if out:
        (out / "gpu_check.json").write_text(json.dumps(figures, indent=1), encoding="utf-8")
    print(json.dumps(figures))
    return 1 if failed else 0


def _run_section(section: str, train_overrides: list[str]) -> tuple[dict, str]:
    """One section in its own process under its time limit: its figures (or error) with the seconds, and its log."""
    start = time.perf_counter()
    command = [sys.executable, __file__, "--section", section, "--train-overrides", *train_overrides]
    try:
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=LIMITS[section])
        log = result.stdout + result.stderr
        value = (
            _last_json(result.stdout)
            if result.returncode == 0
            else {"error": f"exited {result.returncode}", "tail": log[-3000:]}
        )
    except subprocess.TimeoutExpired as error:
        log = (error.stdout or b"").decode(errors="replace") if isinstance(error.stdout, bytes) else str(error.stdout)
        value = {"error": f"stopped after {LIMITS[section]} s"}
    except ValueError as error:
        value = {"error": str(error), "tail": log[-3000:]}
    value["seconds"] = round(time.perf_counter() - start, 1)
    return value, log


if __name__ == "__main__":
    sys.exit(main())
