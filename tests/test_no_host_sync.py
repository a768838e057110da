"""A training step queues its work without waiting for the device.

On a GPU, an operation whose result shape or value the host needs (``.item()``, ``.nonzero()``, ``.tolist()``, a
copy to the CPU, ``bincount``, ``unique``, ``masked_select``, ...) makes the host wait until the device has
caught up, which starves the device of work. These tests run the step on the CPU with a mode that records every
such operation at the two levels where they show: Python tensor methods (torch function mode) and aten operators
(torch dispatch mode). The GPU check (benchmarks/gpu_check.py) counts the real synchronisations on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from txl_dist.config import OptimConfig
from txl_dist.evaluation import to_device
from txl_dist.model import TransformerXLLM, preset
from txl_dist.training.deepspeed_config import build_torch_optimizer

# aten operators whose output shape or value depends on tensor data (the host must read the device).
SYNCING_OPS = {
    "nonzero",
    "_local_scalar_dense",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "bincount",
    "repeat_interleave",
    "equal",
    "is_nonzero",
    "allclose",
    "nonzero_static",
}
# Tensor methods that hand data to the host.
SYNCING_METHODS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class SyncRecorder(TorchDispatchMode):
    """Records the syncing aten operators and tensor methods called while active."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self._functions = _MethodRecorder(self.calls)

    def __enter__(self):
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._functions.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNCING_OPS:
            self.calls.append(f"aten::{name}")
        return func(*args, **(kwargs or {}))


class _MethodRecorder(TorchFunctionMode):
    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING_METHODS:
            self.calls.append(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _config():
    # lm1b's shape in small: div_val 4, three tail clusters, untied projections.
    return preset(
        "tiny",
        n_token=4000,
        cutoffs=[500, 1500, 3000],
        div_val=4,
        d_embed=64,
        d_model=32,
        n_head=2,
        d_head=16,
        d_inner=64,
        tie_projs=[False] * 4,
        dropout=0.1,
        dropatt=0.1,
        tgt_len=8,
        mem_len=8,
    )


def _step(model, optimizer, inputs, targets, mems, *, plan: bool):
    """One training step as the trainer runs it: the plan is made from the host batch before the copy."""
    rows = model.cluster_rows(targets, torch.device("cpu")) if plan else None
    with SyncRecorder() as recorder:
        loss, mems = model(
            to_device(inputs, torch.device("cpu")),
            to_device(targets, torch.device("cpu")),
            mems,
            cluster_rows=rows,
        )
        loss.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return recorder.calls, mems


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_training_step_never_waits_for_the_device(dtype):
    config = _config()
    torch.manual_seed(0)
    model = TransformerXLLM(config)
    optimizer = build_torch_optimizer(OptimConfig(), model.parameters())
    data = torch.randint(0, config.n_token, (4, 3 * config.tgt_len + 1))
    data[0, :] = 3999  # the last cluster sees targets; other clusters may see none: both paths run
    mems = None
    for segment in range(3):
        window = data[:, segment * config.tgt_len : (segment + 1) * config.tgt_len + 1]
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            calls, mems = _step(model, optimizer, window[:, :-1], window[:, 1:], mems, plan=True)
        assert calls == [], f"segment {segment}: operations that wait for the device: {calls}"


def test_the_recorder_sees_what_a_step_without_a_host_plan_waits_for():
    """Without the host-side plan the adaptive softmax reads the cluster sizes from the targets: the recorder
    must catch it (so that the test above can fail)."""
    config = _config()
    torch.manual_seed(0)
    model = TransformerXLLM(config)
    optimizer = build_torch_optimizer(OptimConfig(), model.parameters())
    data = torch.randint(0, config.n_token, (4, config.tgt_len + 1))
    calls, _ = _step(model, optimizer, data[:, :-1], data[:, 1:], None, plan=False)
    assert "aten::bincount" in calls and "Tensor.tolist" in calls
    with SyncRecorder() as recorder:
        torch.tensor([2.0]).item()
        torch.tensor([0, 3]).nonzero()
    assert recorder.calls == ["Tensor.item", "aten::_local_scalar_dense", "aten::nonzero"]


def test_the_plan_gives_the_same_losses_as_planning_on_the_fly():
    config = _config()
    torch.manual_seed(0)
    model = TransformerXLLM(config).eval()
    data = torch.randint(0, config.n_token, (3, config.tgt_len + 1))
    inputs, targets = data[:, :-1], data[:, 1:]
    with torch.no_grad():
        planned, _ = model(inputs, targets, cluster_rows=model.cluster_rows(targets))
        unplanned, _ = model(inputs, targets)
        log_probs, _ = model(inputs)
    assert torch.equal(planned, unplanned)
    assert torch.allclose(planned, -log_probs.gather(2, targets.unsqueeze(2)).squeeze(2), atol=1e-5)
