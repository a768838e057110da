"""launchers/evaluate.py --text: plain text files scored with the model's tokenizer, without building shards
first, give what building shards of the same text and evaluating them gives; and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from data_tools import build_shards, train_tokenizer
from tests.conftest import ptb_sentences
from tests.launcher import in_process
from txl_dist.export import write_export
from txl_dist.model import TransformerXLLM, preset
from txl_dist.tokenizer import load_tokenizer


def _export(tokenizer, folder, **changes):
    torch.manual_seed(0)
    vocab_size = load_tokenizer(tokenizer).vocab_size
    model = TransformerXLLM(preset("tiny", n_token=vocab_size, **changes))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return write_export(model, model.config, folder, tokenizer_dir=tokenizer)


@pytest.fixture(scope="module")
def word_case(ptb_word_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("score_text")
    sentences = ptb_sentences("valid")
    (root / "a.txt").write_text("".join(line + "\n" for line in sentences[:150]))
    (root / "b.txt").write_text("".join(line + "\n" for line in sentences[150:260]))
    return root, _export(ptb_word_tokenizer, root / "export", cutoffs=[2000, 6000])


def _scores(*args: str) -> dict:
    result = in_process("launchers/evaluate.py", *args, "--no-progress")
    return json.loads(result.stdout) if result.stdout.startswith("{") else result


def test_text_files_score_as_shards_of_them_do(word_case, tmp_path):
    root, export = word_case
    shards = tmp_path / "shards"
    flags = ["--tokenizer", str(export), "--output", str(shards), "--no-progress"]  # the export's tokenizer/
    assert build_shards.main([*flags, "--split", f"test={root / 'a.txt'},{root / 'b.txt'}"]) == 0
    by_shards = tmp_path / "shards.json"
    by_text = tmp_path / "text.json"
    in_process(
        "launchers/evaluate.py", str(export), "--shards", str(shards), "--output", str(by_shards), "--no-progress"
    )
    result = in_process(
        "launchers/evaluate.py",
        str(export),
        "--text",
        str(root / "a.txt"),
        str(root / "b.txt"),
        "--output",
        str(by_text),
        "--no-progress",
    )
    assert "a.txt" in result.stdout and "ppl" in result.stdout
    shards_result, text_result = json.loads(by_shards.read_text()), json.loads(by_text.read_text())
    assert text_result["tokens"] == shards_result["tokens"] > 2000
    assert text_result["loss"] == pytest.approx(shards_result["loss"], rel=1e-6)
    assert text_result["word_ppl"] == pytest.approx(shards_result["word_ppl"], rel=1e-6)
    assert text_result["text"] == [str(root / "a.txt"), str(root / "b.txt")]
    # Other settings are the model's evaluation flags, as for a split.
    shorter = in_process(
        "launchers/evaluate.py", str(export), "--text", str(root / "a.txt"), "--mem-len", "0", "--no-progress"
    )
    assert shorter.stdout != result.stdout


def test_a_byte_model_scores_a_file_as_one_document_with_doc_per_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("".join(line + "\n" for line in ptb_sentences("test")[:80]) + "caf\u00e9 \xff end")
    assert (
        train_tokenizer.main(
            ["--kind", "byte", "--input", str(text), "--output", str(tmp_path / "tok"), "--no-progress"]
        )
        == 0
    )
    export = _export(tmp_path / "tok", tmp_path / "export", cutoffs=[], div_val=1)
    for doc_per in ("line", "file"):
        shards = tmp_path / f"shards_{doc_per}"
        args = ["--tokenizer", str(tmp_path / "tok"), "--output", str(shards), "--split", f"test={text}"]
        assert build_shards.main([*args, "--doc-per", doc_per, "--no-progress"]) == 0
        split = in_process(
            "launchers/evaluate.py",
            str(export),
            "--shards",
            str(shards),
            "--no-progress",
            "--output",
            str(tmp_path / f"{doc_per}.json"),
        )
        scored = in_process(
            "launchers/evaluate.py", str(export), "--text", str(text), "--doc-per", doc_per, "--no-progress"
        )
        expected = json.loads((tmp_path / f"{doc_per}.json").read_text())
        assert f"{expected['tokens']} tokens, loss {expected['loss']:.4f}" in scored.stdout, (
            scored.stdout,
            split.stdout,
        )
        assert "bits/char" in scored.stdout


def test_text_refusals_are_one_line(word_case, tmp_path):
    root, export = word_case
    for args, needle in (
        (["--text", str(root / "missing.txt")], "no such file"),
        (["--text", str(root / "a.txt"), "--split", "valid"], "--shards and --split do not apply"),
        (["--doc-per", "file"], "--doc-per: reads the files of --text"),
    ):
        result = in_process("launchers/evaluate.py", str(export), *args, "--no-progress", check=False)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], result.stderr
    (tmp_path / "empty").mkdir()
    result = in_process("launchers/evaluate.py", str(tmp_path / "empty"), "--text", str(root / "a.txt"), check=False)
    assert result.returncode == 2 and "holds no model txl_dist reads" in result.stderr
