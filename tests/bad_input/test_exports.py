"""Bad exports, as txl_dist.export loads them for every command that reads one (evaluate.py, generate.py, convert.py
export-to-hf, export-to-hub, export-to-original): checksums.json verified, non-finite weights named, and a folder
that is not an export (a training run, shards, a tokenizer, a transformers folder) named for what it is."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tests.bad_input.helpers import _one_line
from tests.launcher import in_process


def _damage_weights(export: Path) -> None:
    """1,000 bytes of the first tensors' data set to 0xFF (NaN as float32), the header left intact."""
    path = export / "model.safetensors"
    data = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start : start + 1000] = b"\xff" * 1000
    path.write_bytes(bytes(data))


# ---- checksums.json and non-finite weights ---------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "change, message",
    [
        ({"checksum": "md5"}, r"checksum 'md5' is not one that txl_dist checks \(it records 'crc32'\)"),
        ({"files": {"model.safetensors": {"bytes": 1.5, "crc32": "00000000"}}}, r"\"bytes\" is 1.5, not a size"),
    ],
)
def test_an_export_whose_checksums_file_is_of_another_kind_is_named(tmp_path, change, message):
    from txl_dist.export import load_model, write_export
    from txl_dist.model import TransformerXLLM, preset

    config = preset("tiny")
    write_export(TransformerXLLM(config), config, tmp_path / "export")
    record = json.loads((tmp_path / "export" / "checksums.json").read_text())
    (tmp_path / "export" / "checksums.json").write_text(json.dumps({**record, **change}))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'export' / 'checksums.json'}: .*{message}"):
        load_model(tmp_path / "export")


# ---- a folder that is not an export ----------------------------------------------------------------------------------


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
    # evaluate.py reads a transformers folder as train.init_from does; it records no shards to score.
    result = in_process("launchers/evaluate.py", str(hf), check=False)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == f"evaluate.py: error: {hf} does not record its shards: pass --shards DIR"
    for path, what in ((small_shards, "a shards folder (manifest.json)"), (empty, None)):
        result = in_process("launchers/evaluate.py", str(path), check=False)
        assert result.returncode == 2
        _one_line(result, f"{path}: {what + ', which ' if what else ''}holds no model txl_dist reads")
    assert not (tmp_path / "out").exists()
