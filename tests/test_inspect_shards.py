"""data_tools.inspect_shards: statistics, --decode, and --verify naming each damaged file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_tools import inspect_shards
from data_tools.shards.writer import ShardWriter
from tests.conftest import ptb_sentences
from txl_dist.data.format import Manifest, SplitEntry, TokenizerIdentity, read_manifest, write_manifest


@pytest.fixture
def shards(ptb_word_shards, tmp_path) -> Path:
    copy = tmp_path / "shards"
    shutil.copytree(ptb_word_shards, copy)
    return copy


def verify(directory: Path, capsys) -> tuple[int, str]:
    status = inspect_shards.main([str(directory), "--verify", "--no-progress"])
    return status, capsys.readouterr().out


def test_statistics_decode_and_a_clean_verify(shards, capsys):
    status, out = verify(shards, capsys)
    assert status == 0 and "verify: all of 9 shards match the manifest" in out
    assert "word tokenizer, vocab_size 10000" in out
    train_row = next(line for line in out.splitlines() if line.startswith("train"))
    train = read_manifest(shards).splits["train"]
    assert train_row.split()[1:5] == [str(len(train.shards)), str(train.blocks), "42,068", "929,589"]
    assert inspect_shards.main([str(shards), "--decode", "2"]) == 0
    out = capsys.readouterr().out
    for split in ("train", "valid", "test"):
        first, second = ptb_sentences(split)[:2]
        assert f"--- {split} document 0 ({len(first.split()) + 1} tokens)\n{' '.join(first.split())}\n" in out
        assert f"--- {split} document 1 ({len(second.split()) + 1} tokens)\n{' '.join(second.split())}\n" in out


def test_verify_names_a_shard_with_a_flipped_byte(shards, capsys):
    shard = shards / "train-000003.tar"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    status, out = verify(shards, capsys)
    assert status == 3  # the verdict: problems found
    assert f"FAIL {shard}: sha256" in out
    assert all(str(shard) in line for line in out.splitlines() if line.startswith("FAIL"))


def test_verify_names_a_truncated_tar(shards, capsys):
    shard = shards / "valid-000000.tar"
    shard.write_bytes(shard.read_bytes()[:50000])
    status, out = verify(shards, capsys)
    assert status == 3  # the verdict: problems found
    assert f"FAIL {shard}: 50000 bytes, the manifest says" in out
    assert f"FAIL {shard}: truncated or damaged tar" in out


def _edit_manifest(directory: Path, edit) -> None:
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_verify_names_a_shard_whose_counts_differ_from_the_manifest(shards, capsys):
    def one_more_document(data):
        data["splits"]["test"]["shards"][0]["documents"] += 1
        data["splits"]["test"]["documents"] += 1

    _edit_manifest(shards, one_more_document)
    status, out = verify(shards, capsys)
    assert status == 3  # the verdict: problems found
    assert f"FAIL {shards / 'test-000000.tar'}: 3761 documents begin here, the manifest says 3762" in out


def test_verify_names_ids_outside_the_vocabulary(shards, capsys):
    def smaller_vocabulary(data):
        data["tokenizer"]["vocab_size"] = 5000

    _edit_manifest(shards, smaller_vocabulary)
    status, out = verify(shards, capsys)
    assert status == 3  # the verdict: problems found
    assert f"FAIL {shards / 'valid-000000.tar'}: block 000000000000: token id" in out
    assert ">= vocab_size 5000" in out


def test_verify_names_a_document_without_its_separator(tmp_path, capsys):
    with ShardWriter(tmp_path, "train", vocab_size=10, dtype=np.uint16, tokens_per_shard=100) as writer:
        writer.add_block(np.array([3, 4, 0, 5, 6, 0]), np.array([0, 3]))
        writer.add_block(np.array([7, 8, 1, 9, 0]), np.array([0, 3]))  # the document at 3 follows 1, not eod 0
    entries = writer.shards
    manifest = Manifest(
        tokenizer=TokenizerIdentity("word", 10, "0" * 64, eos_id=0, eod_id=0),
        dtype="uint16",
        block_tokens=8,
        splits={"train": SplitEntry(documents=4, tokens=11, blocks=2, shards=entries)},
    )
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path).splits["train"].tokens == 11
    status, out = verify(tmp_path, capsys)
    assert status == 3  # the verdict: problems found
    assert f"FAIL {tmp_path / 'train-000000.tar'}: block 000000000001: a document is not preceded by eod_id 0" in out
