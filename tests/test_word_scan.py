"""txl_dist.word_scan (words of UTF-8 bytes found with numpy) against Python's str methods, the packed-key
vocabulary against a dict, the word tokenizer's fast path against its str path, and the synthetic One Billion
Word corpus."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.corpora import synthetic_lm1b
from data_tools.corpora import published
from tests.conftest import ptb_sentences
from txl_dist.tokenizer import load_tokenizer
from txl_dist.word_scan import PackedVocabulary, merge_counts, scan_lines, unpack_keys

REPO = Path(__file__).resolve().parents[1]

# Pieces of text that stress the scanner: every kind of whitespace str.split() knows (and U+200B, which it
# does not), multi-byte characters, words of 8 and 9 bytes (the packed-key limit), NUL and carriage returns.
PIECES = [
    "a",
    "b",
    "é",
    "\U0001f600",
    "abcdefgh",
    "abcdefghi",
    "zzzzzzzzzzzzzzzz",
    " ",
    "  ",
    "\t",
    "\n",
    "\n",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1f",
    "\u200b",
]
# What the scanner leaves to the str path.
DECLINED = ["\xa0", "\x85", "\u2028", "\u3000", "\u2009", "\x00", "\r"]


def _str_lines(text: str) -> list[str]:
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


def test_scanned_words_lines_and_characters_equal_str_split():
    generator = random.Random(7)
    scanned = declined = 0
    for _ in range(4000):
        text = "".join(
            generator.choice(DECLINED if generator.random() < 0.015 else PIECES)
            for _ in range(generator.randint(0, 40))
        )
        data = text.encode("utf-8")
        if generator.random() < 0.05:  # a byte that is not UTF-8
            position = generator.randint(0, len(data))
            data = data[:position] + b"\xff" + data[position:]
        scan = scan_lines(data)
        needs_str = (
            "\x00" in text or "\r" in text or b"\xff" in data or any(c.isspace() and not c.isascii() for c in text)
        )
        assert (scan is None) == needs_str, repr(data)
        if scan is None:
            declined += 1
            continue
        scanned += 1
        words = [word.encode("utf-8") for word in text.split()]
        assert scan.words(np.arange(len(scan.starts))) == words, repr(text)
        lines = _str_lines(text)
        assert scan.words_per_line.tolist() == [len(line.split()) for line in lines], repr(text)
        assert scan.characters_per_line().tolist() == [len(line) for line in lines], repr(text)
        short = scan.short()
        assert unpack_keys(scan.packed_keys(short)) == [word for word in words if len(word) <= 8], repr(text)
    assert scanned > 1000 and declined > 1000


def test_packed_keys_are_distinct_for_distinct_words_and_counts_merge_exactly():
    # Words that differ only after their 8th byte, or by a trailing byte, must not share a key.
    text = "ab abc abcdefgh abcdefgi a é e b ab abcdefgh\n"
    scan = scan_lines(text.encode())
    keys = scan.packed_keys(scan.short())
    assert len(set(keys.tolist())) == len(set(w for w in text.split() if len(w.encode()) <= 8))
    first = np.unique(keys[:5], return_counts=True)
    second = np.unique(keys[5:], return_counts=True)
    merged_keys, merged_counts = merge_counts([first[0], second[0]], [first[1], second[1]])
    counted = dict(zip(unpack_keys(merged_keys), merged_counts.tolist()))
    expected = {}
    for word in text.split():
        expected[word.encode()] = expected.get(word.encode(), 0) + 1
    assert counted == expected
    # Parts that hold no word (blank chunks) merge to nothing, alone or beside words.
    empty = (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64))
    assert [part.tolist() for part in merge_counts([empty[0], empty[0]], [empty[1], empty[1]])] == [[], []]
    keys_only, counts_only = merge_counts([empty[0], first[0]], [empty[1], first[1]])
    assert keys_only.tolist() == first[0].tolist() and counts_only.tolist() == first[1].tolist()


def test_packed_vocabulary_looks_up_like_a_dict():
    generator = np.random.default_rng(3)
    letters = list("abcdefghé")
    words = sorted({"".join(generator.choice(letters, size=int(generator.integers(1, 14)))) for _ in range(60000)})
    words.append("nul\x00inside")  # no packed key: kept with the long words
    vocabulary = PackedVocabulary(words, missing=-7)
    ids = {word: i for i, word in enumerate(words)}
    queries = [words[i] for i in generator.integers(0, len(words) - 1, 20000)] + ["zz", "unknownword", "é" * 9]
    scan = scan_lines(" ".join(queries).encode())
    assert vocabulary.lookup(scan).tolist() == [ids.get(word, -7) for word in queries]
    # Half full at most, so a lookup of an absent key always meets an empty slot.
    assert np.count_nonzero(vocabulary.table_keys) * 2 <= len(vocabulary.table_keys)


def test_word_tokenizer_fast_path_equals_encode_documents(ptb_word_tokenizer):
    tokenizer = load_tokenizer(ptb_word_tokenizer)
    lines = ptb_sentences("valid")[:500]
    lines[3] = "  "  # a line without words is no document
    lines[7] = "new-word-never-seen the"  # outside the vocabulary: <unk>
    data = ("\n".join(lines) + "\n").encode()
    tokens, per_document = tokenizer.encode_scanned_lines(scan_lines(data), np.uint16)
    expected, expected_per_document = tokenizer.encode_documents([[line] for line in lines if line.split()], np.uint16)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == expected.tolist() and per_document.tolist() == expected_per_document.tolist()
    assert tokenizer.unk_id in tokens.tolist()


def test_synthetic_corpus_is_deterministic_and_has_the_lm1b_layout(tmp_path):
    shape = synthetic_lm1b.CorpusShape(scale=0.0005, seed=5)
    one = synthetic_lm1b.write_corpus(tmp_path / "one", shape, workers=1, progress=False)
    # The command line, as users run it, with two processes.
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.corpora.synthetic_lm1b",
            "--output",
            str(tmp_path / "two"),
            "--scale",
            "0.0005",
            "--seed",
            "5",
            "--workers",
            "2",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    root_one = tmp_path / "one" / synthetic_lm1b.ROOT_NAME
    root_two = tmp_path / "two" / synthetic_lm1b.ROOT_NAME
    splits = published.lm1b_splits(root_one)
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [99, 1, 1]
    for relative, _ in shape.files():
        assert (root_one / relative).read_bytes() == (root_two / relative).read_bytes(), relative
    other_seed = synthetic_lm1b.file_text(synthetic_lm1b.CorpusShape(scale=0.0005, seed=6), 0, 153)[0]
    first = (root_one / shape.files()[0][0]).read_bytes()
    assert other_seed != first
    lines = first.decode("utf-8").split("\n")[:-1]
    assert len(lines) == 153 == round(synthetic_lm1b.TRAIN_SENTENCES_PER_FILE * 0.0005)
    assert one["train_sentences"] == 99 * 153 and one["heldout_sentences"] == 50 * 3
    assert json.loads((root_one / "synthetic.json").read_text())["train_words"] == one["train_words"]
    # 1 + Poisson(24.37) words per sentence; about 4 bytes per token with its separator.
    assert 24.0 < one["train_words"] / one["train_sentences"] < 26.8
    assert 3.7 < one["train_bytes"] / (one["train_words"]) < 4.4
    assert not first.isascii()  # one type in 50 has an é, as real text has its accents


def test_synthetic_word_law_has_the_lm1b_statistics():
    shape = synthetic_lm1b.CorpusShape()
    ranks = synthetic_lm1b.sample_ranks(shape, 2_000_000, np.random.default_rng(0))
    assert ranks.min() >= 0 and ranks.max() < shape.vocabulary
    assert 0.04 < np.mean(ranks == 0) < 0.06  # the most frequent word
    assert 0.001 < np.mean(ranks >= 793_000) < 0.003  # outside a 793k-word vocabulary
    table, starts = synthetic_lm1b.spell_words(np.arange(300_000))
    words = table.tobytes().split(b" ")[:-1]
    assert len(words) == len(set(words)) == 300_000
    assert [w.decode() for w in words[:3]] == ["b", "ci", "da"]
    # The spelling of a rank does not depend on which other ranks are spelt with it.
    alone_table, _ = synthetic_lm1b.spell_words(np.array([123_456]))
    assert alone_table.tobytes() == words[123_456] + b" "
