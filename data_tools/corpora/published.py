"""The importers of the benchmarks the authors report on (``--format``: ``FORMATS``): each ``*_splits`` function
gives the train/valid/test inputs of a benchmark as downloaded. `lm1b_splits`, `ptb_splits` and `wikitext_splits`
find the files of their usual layouts (PTB also from the ``treebank`` package); `enwik8_splits` and `text8_splits`
give byte ranges of the one file, or of the file inside its zip (found and CRC-checked by
`data_tools.corpora.zip_member`), at the authors' offsets (`held_out_tail_ranges`), which the character tokenizers
read byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

from data_tools.corpora import zip_member
from data_tools.corpora.inputs import TREEBANK_PREFIX, InputFile, input_files, treebank_text
from data_tools.errors import InputError

FORMATS = ("text", "lm1b", "ptb", "enwik8", "text8", "wikitext")
CHARACTER_FORMATS = ("enwik8", "text8")

# The authors' character benchmarks (their prep_enwik8.py and prep_text8.py): the last 10M bytes held out, valid
# the first 5M of them, test the last 5M.
CHARACTER_CORPUS_BYTES = 100_000_000
HELD_OUT_BYTES = 5_000_000
WIKITEXT_FILES = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens", "test": "wiki.test.tokens"}
WIKITEXT_RENAMED = {"train": "train.txt", "valid": "valid.txt", "test": "test.txt"}  # the authors' getdata.sh

LM1B_TRAIN_DIR = "training-monolingual.tokenized.shuffled"
LM1B_HELDOUT_DIR = "heldout-monolingual.tokenized.shuffled"
LM1B_TRAIN_FILES = tuple(f"news.en-{i:05d}-of-00100" for i in range(1, 100))
LM1B_TEST_FILE = "news.en.heldout-00000-of-00050"
LM1B_DEFAULT_VALID_FILE = "news.en.heldout-00001-of-00050"

PTB_FILES = {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}


def lm1b_splits(directory: str | os.PathLike, valid_file: str = LM1B_DEFAULT_VALID_FILE) -> dict[str, list[InputFile]]:
    """train/valid/test of the ``1-billion-word-language-modeling-benchmark-r13output`` layout.

    The authors' scripts used ``heldout-00000`` for both valid and test, which selects models on the test set;
    here valid is another heldout file and may not be the test file.
    """
    directory = Path(directory)
    if valid_file == LM1B_TEST_FILE:
        raise InputError(
            f"--lm1b-valid {valid_file}: that is the test file; validating on it selects models on the test set "
            f"(the mistake of the original scripts). Choose another heldout file, e.g. {LM1B_DEFAULT_VALID_FILE}"
        )
    train = [directory / LM1B_TRAIN_DIR / name for name in LM1B_TRAIN_FILES]
    layout = {
        "train": train,
        "valid": [directory / LM1B_HELDOUT_DIR / valid_file],
        "test": [directory / LM1B_HELDOUT_DIR / LM1B_TEST_FILE],
    }
    for paths in layout.values():
        for path in paths:
            if not path.is_file():
                raise InputError(f"{path}: missing; expected the One Billion Word layout under {directory}")
    return {split: input_files([str(path) for path in paths]) for split, paths in layout.items()}


def ptb_splits(directory: str | os.PathLike | None = None) -> dict[str, list[InputFile]]:
    """train/valid/test of the Penn Treebank: ``ptb.{train,valid,test}.txt`` in ``directory``, or, without a
    directory, the copy in the ``treebank`` package."""
    if directory is None:
        return {split: [InputFile(TREEBANK_PREFIX + split, len(treebank_text(split)))] for split in PTB_FILES}
    splits = {}
    for split, name in PTB_FILES.items():
        path = Path(directory) / name
        if not path.is_file():
            raise InputError(f"{path}: missing; expected Mikolov's Penn Treebank files {list(PTB_FILES.values())}")
        splits[split] = input_files([str(path)])
    return splits


def held_out_tail_ranges(total: int, held_out: int = HELD_OUT_BYTES) -> dict[str, tuple[int, int]]:
    """The authors' split of a character corpus of ``total`` bytes (prep_enwik8.py, prep_text8.py): train =
    ``data[:-2h]``, valid = ``data[-2h:-h]``, test = ``data[-h:]`` with h = ``held_out`` (5,000,000), as
    [start, stop) byte offsets. For the 100,000,000 bytes of enwik8 and text8: 0-90M, 90M-95M, 95M-100M."""
    if held_out < 1:
        raise InputError(f"--held-out-bytes {held_out}: must be positive")
    if total <= 2 * held_out:
        raise InputError(
            f"a corpus of {total:,} bytes has nothing left for train after 2 x {held_out:,} held-out "
            f"bytes (the authors' split needs more than {2 * held_out:,}; see --held-out-bytes)"
        )
    return {
        "train": (0, total - 2 * held_out),
        "valid": (total - 2 * held_out, total - held_out),
        "test": (total - held_out, total),
    }


def enwik8_splits(path: str | os.PathLike, held_out: int = HELD_OUT_BYTES) -> dict[str, list[InputFile]]:
    """train/valid/test of enwik8 (the file, ``enwik8.zip``, or a directory with either): the byte ranges of
    `held_out_tail_ranges`, every byte kept (the authors' data goes through text files of byte values)."""
    name, member, total = zip_member.character_corpus(path, "enwik8")
    return {
        split: [InputFile(name, stop - start, start, stop, member)]
        for split, (start, stop) in held_out_tail_ranges(total, held_out).items()
    }


# What str.strip() removes among ASCII bytes (text8 is ASCII: its character offsets are byte offsets).
_ASCII_WHITESPACE = frozenset(code for code in range(128) if chr(code).isspace())


def text8_splits(path: str | os.PathLike, held_out: int = HELD_OUT_BYTES) -> dict[str, list[InputFile]]:
    """train/valid/test of text8 (the file, ``text8.zip``, or a directory with either): the ranges of
    `held_out_tail_ranges`, each without the whitespace at its two ends, as the authors' prep_text8.py strips
    each part (text8 begins with a space, and the cuts fall between words or inside them)."""
    name, member, total = zip_member.character_corpus(path, "text8")
    splits = {}
    for split, (start, stop) in held_out_tail_ranges(total, held_out).items():
        start, stop = _strip_range(InputFile(name, stop - start, start, stop, member))
        splits[split] = [InputFile(name, stop - start, start, stop, member)]
    return splits


def _strip_range(input_file: InputFile, window: int = 4096) -> tuple[int, int]:
    """[start, stop) of the input's range without leading and trailing ASCII whitespace."""
    start, stop = input_file.start, input_file.stop
    with input_file.open() as handle:
        while start < stop:
            handle.seek(start)
            data = handle.read(min(window, stop - start))
            kept = next((i for i, byte in enumerate(data) if byte not in _ASCII_WHITESPACE), None)
            if kept is not None:
                start += kept
                break
            start += len(data)
        while stop > start:
            handle.seek(max(start, stop - window))
            data = handle.read(stop - max(start, stop - window))
            kept = next((i for i in range(len(data) - 1, -1, -1) if data[i] not in _ASCII_WHITESPACE), None)
            if kept is not None:
                stop -= len(data) - 1 - kept
                break
            stop -= len(data)
    if start >= stop:
        raise InputError(f"{input_file.name}: bytes {input_file.start}-{input_file.stop} hold only whitespace")
    return start, stop


def wikitext_splits(directory: str | os.PathLike) -> dict[str, list[InputFile]]:
    """train/valid/test of WikiText-103 or WikiText-2: ``wiki.{train,valid,test}.tokens`` in ``directory`` (the
    unzipped download), or the authors' renamed ``train.txt``, ``valid.txt``, ``test.txt``."""
    directory = Path(directory)
    for names in (WIKITEXT_FILES, WIKITEXT_RENAMED):
        paths = {split: directory / name for split, name in names.items()}
        if all(p.is_file() for p in paths.values()):
            return {split: input_files([str(p)]) for split, p in paths.items()}
    raise InputError(
        f"{directory}: expected {', '.join(WIKITEXT_FILES.values())} (or the authors' renamed "
        f"{', '.join(WIKITEXT_RENAMED.values())}); unzip wikitext-103-v1.zip and pass its folder"
    )
