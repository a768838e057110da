"""DeepSpeed behind one seam (`txl_dist.deepspeed_internals`): no other module of txl_dist reaches beneath
DeepSpeed's public API, the installed DeepSpeed lies within the range pyproject.toml declares (whose upper bound is
the newest version the seam was checked on), and each piece of the seam works against the installed DeepSpeed."""

from __future__ import annotations

import ast
import datetime
import io
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from txl_dist import deepspeed_internals as internals

ROOT = Path(__file__).resolve().parents[1]

INTERNAL = (
    "deepspeed.runtime",
    "deepspeed.checkpoint",
    "deepspeed.utils.zero_to_fp32",
    "deepspeed.ops",
    "deepspeed.comm.torch",
    "deepspeed.constants",
)
"""DeepSpeed's modules beneath its public API: reached from txl_dist.deepspeed_internals only."""


def internal_uses(path: Path) -> list[tuple[int, str]]:
    """(line, DeepSpeed module) of each import of an `INTERNAL` module in PATH, in any form (``import a.b``,
    ``from a import b``, inside a function or not), and of each string that is a dotted path into one (a name
    handed to importlib)."""

    def internal(name: str) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for prefix in INTERNAL)

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if internal(node.module) else [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isascii():
            names = [node.value] if node.value.replace(".", "").replace("_", "").isalnum() else []
        else:
            continue
        found += [(node.lineno, name) for name in names if internal(name)]
    return sorted(found)


def _modules() -> dict[str, Path]:
    return {path.relative_to(ROOT).as_posix(): path for path in sorted((ROOT / "txl_dist").rglob("*.py"))}


def test_no_module_but_the_seam_reaches_beneath_deepspeeds_public_api():
    seam = "txl_dist/deepspeed_internals.py"
    outside = [
        f"{name}:{line} uses {module}"
        for name, path in _modules().items()
        if name != seam
        for line, module in internal_uses(path)
    ]
    heading = "DeepSpeed internals outside txl_dist.deepspeed_internals (add a function there):"
    assert not outside, "\n".join([heading, *outside])
    assert internal_uses(_modules()[seam]), "the seam uses no DeepSpeed internal: the scan is blind"


def test_the_scan_sees_each_form_of_use(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        '"""Docstrings may name deepspeed.runtime.engine freely."""\n'
        "import deepspeed\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "from deepspeed.utils import zero_to_fp32\n"  # 4
        "import deepspeed.ops.op_builder\n"  # 5
        "def f():\n"
        "    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig\n"  # 7
        "NAMES = ('deepspeed.runtime.fp16.loss_scaler.LossScaler',)\n"  # 8
        "from deepspeed.comm.torch import build_shm_op\n",  # 9
        encoding="utf-8",
    )
    assert internal_uses(source) == [
        (4, "deepspeed.utils.zero_to_fp32"),
        (5, "deepspeed.ops.op_builder"),
        (7, "deepspeed.runtime.zero.config"),
        (8, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        (9, "deepspeed.comm.torch"),
    ]


def test_importing_the_seam_loads_neither_torch_nor_deepspeed():
    probe = "import sys, txl_dist.deepspeed_internals; print(sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


# ---- the version ----------------------------------------------------------------------------------------------------


def _deepspeed_requirement():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    (requirement,) = [Requirement(line) for line in dependencies if Requirement(line).name == "deepspeed"]
    return requirement


def test_the_installed_deepspeed_lies_within_the_declared_range():
    requirement = _deepspeed_requirement()
    installed = metadata.version("deepspeed")
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"DeepSpeed {installed} is installed; pyproject.toml asks for {requirement}"
    )


def test_the_declared_range_ends_at_the_newest_version_the_seam_was_checked_on():
    from packaging.version import Version

    specifier = _deepspeed_requirement().specifier
    newest = max(Version(version) for version in internals.CHECKED_VERSIONS)
    beyond = Version(f"{newest.major}.{newest.minor}.{newest.micro + 1}")
    assert all(specifier.contains(version) for version in internals.CHECKED_VERSIONS), specifier
    assert not specifier.contains(beyond) and not specifier.contains(f"{newest.major}.{newest.minor + 1}.0"), (
        f"pyproject.toml's deepspeed{specifier} admits releases after {newest}, the newest in "
        f"txl_dist.deepspeed_internals.CHECKED_VERSIONS"
    )
    assert all(version in (internals.__doc__ or "") for version in internals.CHECKED_VERSIONS)


# ---- each piece against the installed DeepSpeed ----------------------------------------------------------------------


def test_the_checkpoint_classes_are_deepspeeds():
    classes = internals.checkpoint_classes()
    assert [f"{c.__module__}.{c.__qualname__}" for c in classes] == list(internals.CHECKPOINT_CLASSES)


def test_the_zero_config_model_is_deepspeeds_and_validates_a_section():
    import pydantic

    model = internals.zero_config_model()
    assert {"stage", "overlap_comm", "reduce_bucket_size"} <= set(model.model_fields)
    assert model(stage=2).stage == 2
    with pytest.raises(pydantic.ValidationError):
        model(no_such_setting=1)


def test_the_process_group_timeout_and_the_shm_op_name_are_deepspeeds():
    from deepspeed.accelerator import get_accelerator

    timeout = internals.process_group_timeout()
    assert isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        pytest.skip(f"the {get_accelerator().device_name()} accelerator has no shared-memory op")
    assert builder.NAME == internals.SHM_OP_NAME


def test_the_wrapper_passes_deepspeeds_checkpoint_engine_through(tmp_path):
    import torch
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from txl_dist.checkpoints import weights_only

    inner = TorchCheckpointEngine()
    engine = type("Engine", (), {"checkpoint_engine": inner})()
    wrapper = internals.CheckpointEngineWrapper.install(engine)
    assert engine.checkpoint_engine is wrapper and internals.CheckpointEngineWrapper.install(engine) is wrapper
    assert wrapper.inner is inner and wrapper.zipfile_serialization is inner.zipfile_serialization
    methods = [name for name in dir(CheckpointEngine) if not name.startswith("_") and name not in ("save", "load")]
    assert methods, "DeepSpeed's CheckpointEngine has no methods: not the class this was checked against"
    assert all(getattr(wrapper, name) == getattr(inner, name) for name in methods)
    wrapper.save({"w": torch.arange(3)}, str(tmp_path / "file.pt"))
    with weights_only.deepspeed_loads_weights_only():
        assert torch.equal(wrapper.load(str(tmp_path / "file.pt"), map_location="cpu")["w"], torch.arange(3))


def test_progress_bars_are_left_out_and_every_other_line_passes():
    from tqdm import tqdm

    def run(shown: bool) -> str:
        target = io.StringIO()
        original, sys.stderr = sys.stderr, target
        try:
            with internals._progress_bars(shown):
                print("before", file=sys.stderr)
                for _ in tqdm(range(3), desc="Loading checkpoint shards", mininterval=0):
                    pass
                print("a warning", file=sys.stderr)
                sys.stderr.write("unfinished")
        finally:
            sys.stderr = original
        return target.getvalue()

    assert run(shown=False) == "before\na warning\nunfinished"
    shown = run(shown=True)
    assert "Loading checkpoint shards" in shown and shown.startswith("before\n") and shown.endswith("unfinished")


ZERO_CHECKPOINT = r"""
import contextlib, io, json, sys
from pathlib import Path

import deepspeed, torch

from txl_dist import deepspeed_internals as internals
from txl_dist.checkpoints import weights_only

out = Path(sys.argv[1])
result = {"shm_op": internals.build_shm_op() is not None}
deepspeed.init_distributed(dist_backend="gloo", timeout=internals.process_group_timeout())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
for _ in range(2):
    engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
    engine.step()


class Recording(internals.CheckpointEngineWrapper):
    def __init__(self, inner):
        super().__init__(inner)
        self.saved = []

    def save(self, state_dict, path):
        self.saved.append(Path(path).name)
        super().save(state_dict, path)


recorder = Recording.install(engine)
result["installed_once"] = Recording.install(engine) is recorder is engine.checkpoint_engine
engine.save_checkpoint(str(out / "checkpoints"), tag="step2", save_latest=False)
result["saved"] = sorted(recorder.saved)
live = {name: parameter.detach().clone() for name, parameter in engine.module.named_parameters()}


def same(weights):
    return sorted(weights) == sorted(live) and all(
        torch.equal(weights[name].reshape(live[name].shape), live[name]) for name in live
    )


def consolidate(progress):
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        with weights_only.deepspeed_loads_weights_only():
            weights = internals.consolidate_zero_checkpoint(out / "checkpoints", "step2", progress=progress)
    return same(weights), stderr.getvalue()


result["quiet"], result["quiet_stderr"] = consolidate(progress=False)
result["shown"], result["shown_stderr"] = consolidate(progress=True)
with contextlib.redirect_stdout(io.StringIO()), weights_only.deepspeed_loads_weights_only():
    internals.convert_to_universal(out / "checkpoints" / "step2", out / "universal")
zero = out / "universal" / "zero"
result["universal"] = same({name: weights_only.load(zero / name / "fp32.pt")["param"] for name in live})
result["moments"] = all((zero / name / "exp_avg.pt").is_file() for name in live)
print("RESULT", json.dumps(result), flush=True)
"""


def test_the_seam_consolidates_converts_and_records_a_real_zero_checkpoint(tmp_path, deepspeed_op_cache):
    """A single-rank ZeRO-2 engine (gloo, in a child process so that no process group leaks into other tests)
    saves through a wrapper of its checkpoint engine; the seam consolidates the checkpoint into the live weights,
    with and without DeepSpeed's bars, and converts it to the universal layout holding the same weights."""
    from tests.launcher import free_port

    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),  # recorded: the fixture removes this run's shared-memory buffer
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", ZERO_CHECKPOINT, str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.split(" ", 1)[1])
    assert result["shm_op"] and result["installed_once"], result
    assert "mp_rank_00_model_states.pt" in result["saved"], result["saved"]
    assert any(name.endswith("optim_states.pt") for name in result["saved"]), result["saved"]
    assert result["quiet"] and result["shown"] and result["universal"] and result["moments"], result
    assert "Loading checkpoint shards" in result["shown_stderr"], result["shown_stderr"]
    assert "Loading checkpoint shards" not in result["quiet_stderr"] and "\r" not in result["quiet_stderr"], result
