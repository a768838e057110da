"""Fixtures of the bad-input tests, built once for the package: small PTB shards and byte and char models (the
export of a tiny PTB model, `ptb_export`, is tests/conftest.py's). Treat their folders as read-only (copy one before
damaging it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data_tools import build_shards, train_tokenizer
from tests.conftest import ptb_sentences
from txl_dist.export import write_export
from txl_dist.model import TransformerXLLM, preset
from txl_dist.tokenizer import load_tokenizer


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def character_models(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per kind (byte, char): a tokenizer of PTB valid's text, the shards of its first 50 sentences (split test)
    and of all of it (split valid, 400k characters), and an export of an untrained tiny model."""
    root = tmp_path_factory.mktemp("character_models")
    text = root / "valid.txt"
    text.write_text("".join(line + "\n" for line in ptb_sentences("valid")), encoding="utf-8")
    short = root / "short.txt"
    short.write_text("".join(line + "\n" for line in ptb_sentences("valid")[:50]), encoding="utf-8")
    models = {}
    for kind in ("byte", "char"):
        folder = root / kind
        assert (
            train_tokenizer.main(
                ["--kind", kind, "--input", str(text), "--output", str(folder / "tok"), "--no-progress"]
            )
            == 0
        )
        splits = ["--split", f"test={short}", "--split", f"valid={text}", "--no-progress"]
        assert build_shards.main(["--tokenizer", str(folder / "tok"), "--output", str(folder / "shards"), *splits]) == 0
        vocab_size = load_tokenizer(folder / "tok").vocab_size
        torch.manual_seed(0)
        model = TransformerXLLM(preset("tiny", n_token=vocab_size, cutoffs=[], div_val=1))
        write_export(model, model.config, folder / "export", tokenizer_dir=folder / "tok")
        models[kind] = {"tokenizer": folder / "tok", "shards": folder / "shards", "export": folder / "export"}
    return models
