"""Shared fixtures: the Penn Treebank as files, PTB tokenizers and shards, a fabricated One Billion Word layout.

Session-scoped and built through the real command-line entry points; treat their directories as read-only
(copy one before damaging it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import treebank

from data_tools import build_shards, corpus, train_tokenizer

# Small blocks and shards so that the PTB splits span several of each (train: ~227 blocks, 8 shards).
PTB_TOKENS_PER_BLOCK = 4096
PTB_TOKENS_PER_SHARD = 131072


def ptb_sentences(split: str) -> list[str]:
    """The sentences (non-blank lines) of a PTB split, as in the treebank package."""
    return [line for line in treebank.penn[split].split("\n") if line.strip()]


@pytest.fixture(scope="session")
def ptb_text_dir(tmp_path_factory) -> Path:
    """``ptb.{train,valid,test}.txt`` written from the treebank package."""
    directory = tmp_path_factory.mktemp("ptb_text")
    for split, name in corpus.PTB_FILES.items():
        (directory / name).write_text(treebank.penn[split], encoding="utf-8")
    return directory


@pytest.fixture(scope="session")
def ptb_word_tokenizer(tmp_path_factory) -> Path:
    """The standard 10,000-word PTB vocabulary (``<eos>`` first, ``<unk>`` a word of the text)."""
    directory = tmp_path_factory.mktemp("ptb_word_tokenizer")
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--format", "ptb", "--output", str(directory), "--overwrite", "--no-progress"]
        )
        == 0
    )
    return directory


@pytest.fixture(scope="session")
def ptb_sentencepiece_tokenizer(tmp_path_factory) -> Path:
    """A 2,000-piece BPE model of PTB train covering all its characters, with an end-of-document symbol
    ``<eod>`` (eod_id != eos_id). SentencePiece reads the text ``<unk>`` as unknown characters."""
    directory = tmp_path_factory.mktemp("ptb_sentencepiece_tokenizer")
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "sentencepiece",
                "--model-type",
                "bpe",
                "--vocab-size",
                "2000",
                "--character-coverage",
                "1.0",
                "--eod-symbol",
                "<eod>",
                "--format",
                "ptb",
                "--output",
                str(directory),
                "--overwrite",
                "--no-progress",
            ]
        )
        == 0
    )
    return directory


@pytest.fixture(scope="session")
def ptb_word_shards(tmp_path_factory, ptb_word_tokenizer) -> Path:
    """PTB train/valid/test shards of the word tokenizer (blocks of 4,096 tokens, shards of 131,072)."""
    directory = tmp_path_factory.mktemp("ptb_word_shards")
    assert (
        build_shards.main(
            [
                "--tokenizer",
                str(ptb_word_tokenizer),
                "--output",
                str(directory),
                "--format",
                "ptb",
                "--tokens-per-block",
                str(PTB_TOKENS_PER_BLOCK),
                "--tokens-per-shard",
                str(PTB_TOKENS_PER_SHARD),
                "--overwrite",
                "--no-progress",
            ]
        )
        == 0
    )
    return directory


@pytest.fixture(scope="session")
def fabricated_lm1b_dir(tmp_path_factory) -> Path:
    """The One Billion Word r13output layout filled with PTB sentences: the 99 training files hold PTB train
    in order, heldout-00000 (test) holds PTB test and heldout-00001 (valid) holds PTB valid."""
    root = tmp_path_factory.mktemp("lm1b") / "1-billion-word-language-modeling-benchmark-r13output"
    (root / corpus.LM1B_TRAIN_DIR).mkdir(parents=True)
    (root / corpus.LM1B_HELDOUT_DIR).mkdir()
    train = ptb_sentences("train")
    per_file = -(-len(train) // len(corpus.LM1B_TRAIN_FILES))
    for i, name in enumerate(corpus.LM1B_TRAIN_FILES):
        lines = train[i * per_file : (i + 1) * per_file]
        (root / corpus.LM1B_TRAIN_DIR / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    for split, name in (("test", corpus.LM1B_TEST_FILE), ("valid", corpus.LM1B_DEFAULT_VALID_FILE)):
        (root / corpus.LM1B_HELDOUT_DIR / name).write_text(
            "".join(line + "\n" for line in ptb_sentences(split)), encoding="utf-8"
        )
    return root


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    """Every DeepSpeed run on the CPU accelerator leaves /dev/shm/deepspeed_allreduce_buffer_* files (66 MiB
    each, named ``..._{master address}_{master port}_{rank}``): remove this test's after it so they do not pile up
    in memory. Only the ports this session handed out: removing another session's live buffer (a parallel run on a
    shared machine) makes its ranks wait for each other forever in DeepSpeed's start-up."""
    from tests.launcher import remove_shm_buffers

    yield
    remove_shm_buffers()
