"""Bad input, round two (issue 22): each case ends in one clear line with a non-zero exit, or in correct handling.

Cheap by design: the launchers' main functions in this process, a tiny model, a few hundred PTB sentences.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch

from data_tools import build_shards
from tests.conftest import ptb_sentences
from tests.launcher import in_process


def _one_line(result, *needles: str) -> str:
    """The single stderr line of a refused command, holding every needle."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if "warning" not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def small_shards(ptb_word_tokenizer, tmp_path_factory) -> Path:
    """train/valid/test of 100 PTB sentences each, in the PTB word vocabulary."""
    root = tmp_path_factory.mktemp("small_text")
    sentences = ptb_sentences("valid")
    args = ["--tokenizer", str(ptb_word_tokenizer), "--output", str(root / "shards"), "--no-progress"]
    for index, split in enumerate(("train", "valid", "test")):
        (root / f"{split}.txt").write_text("".join(line + "\n" for line in sentences[index * 100 : (index + 1) * 100]))
        args += ["--split", f"{split}={root / f'{split}.txt'}"]
    assert build_shards.main(args) == 0
    return root / "shards"


@pytest.fixture(scope="module")
def ptb_export(ptb_word_tokenizer, tmp_path_factory) -> Path:
    """An export of a tiny untrained model with the PTB word tokenizer."""
    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset
    from txl_dist.tokenizer import load_tokenizer

    vocab_size = load_tokenizer(ptb_word_tokenizer).vocab_size
    torch.manual_seed(0)
    model = TransformerXLLM(preset("tiny", n_token=vocab_size, cutoffs=[2000, 6000]))
    return write_export(
        model, model.config, tmp_path_factory.mktemp("exports") / "ptb_tiny", tokenizer_dir=ptb_word_tokenizer
    )


def _damage_weights(export: Path) -> None:
    """1,000 bytes of the first tensors' data set to 0xFF (NaN as float32), the header left intact."""
    path = export / "model.safetensors"
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start : start + 1000] = b"\xff" * 1000
    path.write_bytes(bytes(data))


# ---- item 2: exports are verified, non-finite weights refused by name -------------------------------------------


def test_a_damaged_export_is_refused_on_load_and_no_verify_names_the_non_finite_tensor(
    ptb_export, small_shards, tmp_path
):
    from safetensors import safe_open

    damaged = tmp_path / "damaged"
    shutil.copytree(ptb_export, damaged)
    _damage_weights(damaged)
    evaluate = ["launchers/evaluate.py", str(damaged), "--shards", str(small_shards), "--no-progress"]
    for command in (
        evaluate,
        ["launchers/generate.py", str(damaged), "--prompt", "the company"],
        ["launchers/convert.py", "export-to-hub", str(damaged), str(tmp_path / "hub")],
        ["launchers/convert.py", "export-to-hf", str(damaged), str(tmp_path / "hf")],
    ):
        _one_line(in_process(*command, check=False), "model.safetensors", "CRC-32", "checksums.json")
    assert not (tmp_path / "hub").exists() and not (tmp_path / "hf").exists()

    with safe_open(str(damaged / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    nan_tensors = [name for name, tensor in tensors.items() if not torch.isfinite(tensor).all()]
    assert nan_tensors
    for command in (evaluate, ["launchers/generate.py", str(damaged), "--prompt", "the company"]):
        result = in_process(*command, "--no-verify", check=False)
        _one_line(result, nan_tensors[0], "NaN or infinity")
        assert "warning: --no-verify" in result.stderr
    assert not list(damaged.glob("eval_*.json"))


def test_an_export_without_checksums_loads_with_a_warning_and_a_good_one_silently(
    ptb_export, small_shards, tmp_path, caplog
):
    result = in_process(
        "launchers/evaluate.py",
        str(ptb_export),
        "--shards",
        str(small_shards),
        "--no-progress",
        "--output",
        str(tmp_path / "eval.json"),
    )
    assert "not verified" not in caplog.text + result.stderr
    json.loads((tmp_path / "eval.json").read_text())
    listed = json.loads((ptb_export / "checksums.json").read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer/tokenizer.json"} <= set(listed)

    old = tmp_path / "old"
    shutil.copytree(ptb_export, old)
    (old / "checksums.json").unlink()
    result = in_process(
        "launchers/generate.py", str(old), "--prompt", "the company", "--greedy", "--max-new-tokens", "3"
    )
    assert result.stdout.startswith("the company")
    assert "checksums.json" in caplog.text and "not verified" in caplog.text


def test_evaluate_writes_no_nan_when_finite_weights_overflow(ptb_word_tokenizer, small_shards, tmp_path):
    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset
    from txl_dist.tokenizer import load_tokenizer

    model = TransformerXLLM(preset("tiny", n_token=load_tokenizer(ptb_word_tokenizer).vocab_size, cutoffs=[2000, 6000]))
    with torch.no_grad():
        model.layers[0].dec_attn.qkv_net.weight.fill_(1e30)  # finite, but the attention scores overflow to inf
    export = write_export(model, model.config, tmp_path / "export", tokenizer_dir=ptb_word_tokenizer)
    result = in_process(
        "launchers/evaluate.py", str(export), "--shards", str(small_shards), "--no-progress", check=False
    )
    _one_line(result, "the loss on split 'test'", "is nan, with finite weights", "no result written")
    assert not list(export.glob("eval_*.json"))


# ---- item 6, item 10 and the smaller ones of generate.py and evaluate.py ------------------------------------------


def test_generate_refuses_zero_samples(ptb_export):
    _one_line(
        in_process("launchers/generate.py", str(ptb_export), "--prompt", "the", "--num-samples", "0", check=False),
        "--num-samples 0",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")
def test_generate_on_cuda_without_cuda_is_one_line(ptb_export):
    _one_line(
        in_process("launchers/generate.py", str(ptb_export), "--prompt", "the", "--device", "cuda", check=False),
        "--device cuda",
        "no CUDA device",
    )


@pytest.fixture
def training_run(tmp_path) -> Path:
    """A run folder as launchers/train.py leaves it (the names only): metrics.jsonl, checkpoints/latest and a
    checkpoint with its COMPLETE.json."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step00000005").mkdir(parents=True)
    (run / "checkpoints" / "step00000005" / "COMPLETE.json").write_text('{"step": 5}\n')
    (run / "checkpoints" / "latest").write_text("step00000005\n")
    (run / "metrics.jsonl").write_text('{"step": 5, "kind": "train", "loss": 6.1}\n')
    return run


def test_a_command_that_reads_an_export_given_a_training_folder_gives_the_export_command(training_run, tmp_path):
    """generate.py and the convert subcommands that read an export, given the run, its checkpoints folder or one
    checkpoint: one line saying which it is and the zero-to-export command (no warning about checksums.json, no
    "config.json: missing"); a missing path or a file is named as such."""
    commands = {
        "generate.py": ("launchers/generate.py", "{path}", "--prompt", "the"),
        "generate.py --no-verify": ("launchers/generate.py", "{path}", "--prompt", "the", "--no-verify"),
        "convert.py export-to-hf": ("launchers/convert.py", "export-to-hf", "{path}", str(tmp_path / "hf")),
        "convert.py export-to-hub": ("launchers/convert.py", "export-to-hub", "{path}", str(tmp_path / "hub")),
        "convert.py export-to-original": (
            "launchers/convert.py",
            "export-to-original",
            "{path}",
            str(tmp_path / "o.pt"),
        ),
    }
    folders = {
        training_run: "a training run folder",
        training_run / "checkpoints": "a training run's checkpoints folder",
        training_run / "checkpoints" / "step00000005": "a training checkpoint",
    }
    for name, command in commands.items():
        for path, kind in folders.items():
            result = in_process(*[part.format(path=path) for part in command], check=False)
            errors = [line for line in result.stderr.splitlines() if "--no-verify:" not in line]
            assert result.returncode == 2 and errors == [
                f"{name.split(' --')[0]}: error: {path}: {kind}, not an export folder (no config.json); export it "
                f"first: python launchers/convert.py zero-to-export {path} EXPORT_DIR"
            ], (name, path, result.stderr)
        for path, named in (
            (tmp_path / "missing", "no such export folder"),
            (training_run / "metrics.jsonl", "a file"),
        ):
            _one_line(in_process(*[part.format(path=path) for part in command], check=False), f"{path}: {named}")
    assert not [p for p in tmp_path.iterdir() if p.name != "run"]


def test_a_command_that_reads_an_export_given_a_folder_of_something_else_says_what_it_is(
    ptb_export, small_shards, ptb_word_tokenizer, tmp_path, caplog
):
    """generate.py (verified or not), evaluate.py and convert.py export-to-hf given shards, a tokenizer, an
    export's own tokenizer folder, the transformers folders convert.py writes, or a folder of nothing: one line
    saying what the folder is and what to give instead, status 2; never the warning about an export without
    checksums.json, nor "config.json: missing"."""
    hf, hub, empty = tmp_path / "hf", tmp_path / "hub", tmp_path / "empty"
    in_process("launchers/convert.py", "export-to-hf", str(ptb_export), str(hf))
    in_process("launchers/convert.py", "export-to-hub", str(ptb_export), str(hub))
    empty.mkdir()
    give_an_export = "give an export folder, which python launchers/convert.py zero-to-export RUN_DIR EXPORT_DIR writes"
    transformers = "not a txl_dist export folder: give the export folder it was converted from, or load it with "
    transformers += "transformers"
    folders = {
        small_shards: f"a shards folder (manifest.json), not an export folder (no config.json): {give_an_export}",
        ptb_word_tokenizer: f"a tokenizer folder (tokenizer.json), not an export folder (no config.json): "
        f"{give_an_export}",
        ptb_export / "tokenizer": f"the tokenizer folder of the export {ptb_export}, not an export folder: give "
        f"{ptb_export}",
        empty: f"not an export folder (no config.json): {give_an_export}",
        hf: "a folder for Hugging Face transformers (config.json's model_type is 'transfo-xl'; convert.py "
        f"export-to-hf writes those), {transformers}",
        hub: f"a folder for Hugging Face transformers (convert.py export-to-hub writes for transformers 5), "
        f"{transformers}",
    }
    commands = {
        "generate.py": ("launchers/generate.py", "{path}", "--prompt", "the"),
        "generate.py --no-verify": ("launchers/generate.py", "{path}", "--prompt", "the", "--no-verify"),
        "convert.py export-to-hf": ("launchers/convert.py", "export-to-hf", "{path}", str(tmp_path / "out")),
    }
    for name, command in commands.items():
        for path, what in folders.items():
            caplog.clear()
            result = in_process(*[part.format(path=path) for part in command], check=False)
            assert result.returncode == 2 and result.stderr.splitlines() == [
                f"{name.split(' --')[0]}: error: {path}: {what}"
            ], (name, path, result.stderr)
            assert "checksums.json" not in caplog.text, (name, path, caplog.text)
    result = in_process("launchers/evaluate.py", str(hf), check=False)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == f"evaluate.py: error: {hf}: {folders[hf]}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--top-p", "nan"], "top_p=nan must be in (0, 1]"),
        (["--temperature", "-1"], "temperature=-1.0 must be > 0"),
        (["--top-k", "-2"], "top_k=-2 must be an integer >= 0"),
    ],
)
def test_bad_sampling_settings_are_refused_before_the_prompt_is_echoed(ptb_export, flags, named):
    """The refusal once came glued to the echoed prompt ("thegenerate.py: error: ...")."""
    result = in_process("launchers/generate.py", str(ptb_export), "--prompt", "the", *flags, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("generate.py: error: ") and named in result.stderr
    _one_line(result, named)


def test_a_prompt_of_unknown_words_gets_a_warning(ptb_export):
    result = in_process(
        "launchers/generate.py", str(ptb_export), "--prompt", "zqxv wvvqz", "--greedy", "--max-new-tokens", "2"
    )
    assert "warning: 2 of the 2 tokens of the prompt 'zqxv wvvqz' are the unknown token" in result.stderr
    result = in_process(
        "launchers/generate.py", str(ptb_export), "--prompt", "the company", "--greedy", "--max-new-tokens", "2"
    )
    assert "unknown" not in result.stderr


def test_evaluate_refuses_batch_size_zero(ptb_export, small_shards):
    _one_line(
        in_process(
            "launchers/evaluate.py", str(ptb_export), "--shards", str(small_shards), "--batch-size", "0", check=False
        ),
        "--batch-size 0",
    )


# ---- item 9: hf-to-export on a crafted pickle or a truncated safetensors file ------------------------------------


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_hf_to_export_refuses_a_crafted_pickle_and_a_truncated_file_in_one_line(ptb_export, tmp_path):
    hf = tmp_path / "hf"
    in_process("launchers/convert.py", "export-to-hf", str(ptb_export), str(hf))
    weights = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    _one_line(
        in_process("launchers/convert.py", "hf-to-export", str(hf), str(tmp_path / "a"), check=False),
        "model.safetensors",
        "not a readable safetensors file",
    )

    (hf / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    with open(hf / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"crit.cluster_weight": _RunsCode(marker)}, handle, protocol=2)
    _one_line(
        in_process("launchers/convert.py", "hf-to-export", str(hf), str(tmp_path / "b"), check=False),
        "pytorch_model.bin",
        "refused to unpickle",
    )
    assert not marker.exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- item 1: build_shards and train_tokenizer never delete their own input ----------------------------------------


def test_build_shards_refuses_inputs_inside_its_output_before_deleting_anything(
    ptb_word_tokenizer, small_shards, tmp_path, capsys
):
    shards = tmp_path / "shards"
    shutil.copytree(small_shards, shards)
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    status = build_shards.main(
        [
            "--tokenizer",
            str(ptb_word_tokenizer),
            "--output",
            str(shards),
            "--overwrite",
            "--split",
            f"train={shards}/train*",
            "--no-progress",
        ]
    )
    error = capsys.readouterr().err
    assert status == 2 and error.count("\n") == 1
    assert f"output {shards} contains the input {shards}/train-000000.tar" in error
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before  # manifest.json and shards kept


def test_train_tokenizer_refuses_inputs_inside_its_output(tmp_path, capsys):
    from data_tools import train_tokenizer

    text = tmp_path / "tok" / "corpus.txt"
    text.parent.mkdir()
    text.write_text("a b c\n")
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--input", str(text), "--output", str(tmp_path / "tok"), "--overwrite", "--no-progress"]
        )
        == 2
    )
    assert f"contains the input {text}" in capsys.readouterr().err
    assert text.read_text() == "a b c\n"


def test_train_tokenizer_leaves_no_empty_output_folder_when_it_refuses_its_input(tmp_path, capsys):
    from data_tools import train_tokenizer

    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--input", str(empty), "--output", str(tmp_path / "new" / "tok"), "--no-progress"]
        )
        == 2
    )
    assert "no document in the input" in capsys.readouterr().err
    assert not (tmp_path / "new" / "tok").exists()


# ---- item 5: --holdout given twice ------------------------------------------------------------------------------


def test_a_second_holdout_is_refused_not_dropped(ptb_word_tokenizer, tmp_path, capsys):
    text = tmp_path / "train.txt"
    text.write_text("".join(line + "\n" for line in ptb_sentences("valid")[:50]))
    status = build_shards.main(
        [
            "--tokenizer",
            str(ptb_word_tokenizer),
            "--output",
            str(tmp_path / "shards"),
            "--split",
            f"train={text}",
            "--holdout",
            "valid=0.05",
            "--holdout",
            "test=0.05",
            "--no-progress",
        ]
    )
    error = capsys.readouterr().err
    assert status == 2 and error.count("\n") == 1
    assert "--holdout is given 2 times (valid=0.05, test=0.05)" in error
    assert not (tmp_path / "shards").exists()


# ---- item 3: the planner applies the trainer's layout rules; its status says whether a layout fits ----------------


def test_the_planner_refuses_layouts_the_trainer_refuses_and_exits_non_zero_when_none_fits(capsys):
    from txl_dist import plan
    from txl_dist.config import load_config

    base = ["--config", "configs/tiny_cpu.yaml", "--device", "cpu"]
    for args in (
        ["--world-size", "3", "train.micro_batch=null"],
        ["--world-size", "1000000"],
        ["--world-size", "1", "--micro-batch", "3"],
    ):
        with pytest.raises(SystemExit) as exited:
            plan.main(base + args)
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert "error: " in error and "train.global_batch=8" in error and "memory plan" not in error
    assert plan.main(base + ["--world-size", "2", "--device-memory", "1MiB"]) == 3  # the verdict "does not fit"
    assert "no micro-batch fits" in capsys.readouterr().out
    assert plan.main(base + ["--world-size", "2", "--device-memory", "4GiB"]) == 0
    assert "micro-batch 2 fits" in capsys.readouterr().out

    cfg = load_config(["configs/tiny_cpu.yaml"], ["train.micro_batch=null", "train.global_batch=12"])
    for world_size in (1, 2, 3, 5, 8, 12, 24):
        fit = plan.largest_micro_batch(cfg, world_size, 4 * plan.GiB, "cpu")
        accepted = []
        for micro_batch in range(1, 13):
            try:
                accepted.append(cfg.train.batch_layout(world_size, micro_batch))
            except ValueError:
                pass
        if not accepted:
            assert fit.micro_batch is None
        else:
            layout = cfg.train.batch_layout(world_size, fit.micro_batch)
            assert (fit.micro_batch, fit.grad_accum) == (layout.micro_batch, layout.grad_accum)
            assert fit.micro_batch * fit.grad_accum * world_size == 12


# ---- item 4: what a run needs is checked before any process group starts ------------------------------------------

from tests.test_run_integrity import _read_only, small_tmpfs  # noqa: E402,F401 -- a 2 MB tmpfs fixture (root)


def _parse_run(*overrides: str):
    from txl_dist.training.cli import parse_run_args

    return parse_run_args(["--config", "configs/tiny_cpu.yaml", *overrides], world_size=2, device="cpu")


def test_a_missing_eval_split_is_refused_before_the_run_starts(ptb_word_tokenizer, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(line + "\n" for line in ptb_sentences("valid")[:200]))
    shards = tmp_path / "shards"
    assert (
        build_shards.main(
            [
                "--tokenizer",
                str(ptb_word_tokenizer),
                "--output",
                str(shards),
                "--split",
                f"train={text}",
                "--holdout",
                "test=0.1",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        _parse_run(f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}")
    assert stopped.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"eval.split='valid': {shards / 'manifest.json'} has no such split (it has "
        f"['test', 'train']); build it (data_tools.build_shards --split or "
        f"--holdout) or set eval.split\n"
    )
    _parse_run(f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}", "eval.split=test")
    assert not (tmp_path / "run").exists()


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_run_starts(small_shards, small_tmpfs, capsys):  # noqa: F811
    """A read-only output is a failure of the surroundings (status 1, README), named in one line."""
    _read_only(small_tmpfs)
    with pytest.raises(SystemExit) as stopped:
        _parse_run(f"data.shards={small_shards}", f"train.output_dir={small_tmpfs / 'runs' / 'a'}")
    assert stopped.value.code == 1
    assert capsys.readouterr().err.endswith(
        f"train.output_dir='{small_tmpfs / 'runs' / 'a'}': cannot write in {small_tmpfs}: read-only file system\n"
    )


def test_an_immutable_run_folder_is_a_failure_with_one_line(small_shards, tmp_path, capsys):
    """``chattr +i`` refuses even root (the campaign's read-only run folder): status 1, as for a read-only mount."""
    import subprocess

    run = tmp_path / "run"
    run.mkdir()
    if subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        with pytest.raises(SystemExit) as stopped:
            _parse_run(f"data.shards={small_shards}", f"train.output_dir={run}")
    finally:
        subprocess.run(["chattr", "-i", str(run)], check=True)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"launchers/train.py: error: train.output_dir='{run}': cannot write in {run}: operation not permitted"
    )


@pytest.mark.parametrize("folder", ["checkpoints", "tensorboard"])
def test_an_immutable_folder_the_run_writes_later_is_refused_at_the_start(small_shards, tmp_path, capsys, folder):
    """The audit's neighbour: a resumed run whose checkpoints/ refused writes trained until its first save, then
    ended with DeepSpeed's misleading 'no such file or directory' (permission denied swallowed)."""
    import subprocess

    run = tmp_path / "run"
    (run / folder).mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(run / folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        with pytest.raises(SystemExit) as stopped:
            _parse_run(f"data.shards={small_shards}", f"train.output_dir={run}")
    finally:
        subprocess.run(["chattr", "-i", str(run / folder)], check=True)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"launchers/train.py: error: train.output_dir='{run}': cannot write in {run / folder}: operation not permitted"
    )


def test_a_memory_plan_over_the_device_is_refused_before_the_run_starts(small_shards, tmp_path):
    from txl_dist.plan import MiB, plan_memory
    from txl_dist.training.cli import require_memory_fits

    cfg, _ = _parse_run(f"data.shards={small_shards}", f"train.output_dir={tmp_path / 'run'}")
    with pytest.raises(
        ValueError,
        match=r"micro-batch 2: the memory plan needs 0.\d\d GiB per rank, the cuda device "
        r"has 0.06 GiB; no micro-batch fits: .*train.memory_check=false starts anyway",
    ):
        require_memory_fits(cfg, 2, "cuda", 64 * MiB)
    one = plan_memory(cfg, 2, 1, "cuda").needed()
    assert one < plan_memory(cfg, 2, 2, "cuda").needed()
    with pytest.raises(ValueError, match=r"train.micro_batch=1 \(4 accumulation steps\) fits"):
        require_memory_fits(cfg, 2, "cuda", one)
    require_memory_fits(cfg, 2, "cuda", 80 * 1024 * MiB)
    cfg.train.memory_check = False
    require_memory_fits(cfg, 2, "cuda", 64 * MiB)


# ---- item 7: resuming with another ZeRO stage ---------------------------------------------------------------------


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


# ---- smaller: a configuration error under a launcher is printed once, by the first rank of the node --------------


def test_a_configuration_error_is_printed_by_the_first_rank_of_a_node_only(small_shards, tmp_path, monkeypatch, capsys):
    for local_rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as stopped:
            _parse_run(f"data.shards={small_shards}", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=0")
        assert stopped.value.code == 2
        error = capsys.readouterr().err
        assert ("train.max_steps" in error) == printed and (error == "") != printed
