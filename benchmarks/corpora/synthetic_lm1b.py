"""Write a synthetic corpus with the layout and the statistics of One Billion Word (Chelba et al., 2013).

    # from the repository root (benchmarks/ is not part of the installed package)
    # the full shape: 99 training files and 50 heldout files, 30.3M sentences, 0.8B tokens, ~3.1 GB
    python -m benchmarks.corpora.synthetic_lm1b --output /tmp/lm1b_synthetic --scale 1.0 --workers 2
    # a hundredth of it, for a rehearsal of the whole pipeline in a minute
    python -m benchmarks.corpora.synthetic_lm1b --output /tmp/lm1b_small --scale 0.01

The directory is ``1-billion-word-language-modeling-benchmark-r13output/`` with
``training-monolingual.tokenized.shuffled/news.en-000{01..99}-of-00100`` and
``heldout-monolingual.tokenized.shuffled/news.en.heldout-000{00..49}-of-00050``, so that
``--format lm1b --input DIR`` of `data_tools.train_tokenizer` and `data_tools.build_shards` read it as the real
corpus. At ``--scale 1.0`` each training file holds 306,071 sentences and each heldout file 6,134 (the real
corpus: 30,301,028 training and 306,688 heldout sentences); a sentence holds 1 + Poisson(24.37) words (the real
mean is 25.4 words per sentence), so the training files hold about 768M words and 0.8B tokens with the sentence
ends.

Words. Each word is drawn independently from a Zipf-Mandelbrot law over ``vocabulary`` ranks,
P(rank >= r) proportional to (r + offset)^(1 - exponent) (a discretised Pareto law, sampled in closed form). The
defaults (exponent 1.47, offset 8, 2M ranks) give, at scale 1.0, about 780k types seen at least 3 times (the
real vocabulary has 793,471 with its 3 specials), 1.5M types seen at all, a most frequent word of 4.8% of the
tokens and 0.17% of the tokens outside the 793k most frequent types (the real out-of-vocabulary rate is about
0.3%). The word of rank r spells r in bijective base 21 with consonants, with vowels between and after them to
a length that grows with the rank (frequent words are short: about 3 bytes per word and 4.0 bytes per token
with its separator, as the real corpus's 3.1 GB for 768M words); one type in 50 carries an "é" (2 bytes in
UTF-8), so that most chunks of text are not pure ASCII, as in the real corpus. Removing the vowels gives back
the rank's spelling, so no two ranks share a word.

Deterministic: file i is drawn from a generator seeded with (seed, i), so the bytes depend on the seed and the
scale alone, whatever the number of workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_tools.command_line import OneLineParser
from data_tools.corpora import published
from txl_dist.exit_status import os_error_status, print_error, run_command
from txl_dist.fileio import describe_os_error, ensure_directory

ROOT_NAME = "1-billion-word-language-modeling-benchmark-r13output"
HELDOUT_FILES = tuple(f"news.en.heldout-{i:05d}-of-00050" for i in range(50))
TRAIN_SENTENCES_PER_FILE = 306_071  # 30,301,028 / 99, rounded up
HELDOUT_SENTENCES_PER_FILE = 6_134  # 306,688 / 50, rounded up
CONSONANTS = b"bcdfghjklmnpqrstvwxz"  # 20 letters, plus "y" below: the 21 digits of a rank's spelling
DIGITS = np.frombuffer(CONSONANTS + b"y", dtype=np.uint8)
VOWELS = np.frombuffer(b"aeiou", dtype=np.uint8)
ACCENT = "é".encode()  # the 2-byte vowel of one type in 50


@dataclasses.dataclass(frozen=True)
class CorpusShape:
    """What the corpus looks like; the defaults are One Billion Word's (see the module docstring)."""

    scale: float = 1.0
    """1.0 is the full corpus (0.8B training tokens); the numbers of sentences scale with it, not the vocabulary."""
    seed: int = 0
    vocabulary: int = 2_000_000
    """Ranks of the word law (types that can occur)."""
    exponent: float = 1.47
    offset: float = 8.0
    mean_extra_words: float = 24.37
    """A sentence holds 1 + Poisson(mean_extra_words) words."""

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale {self.scale}: must be positive")
        if self.vocabulary < 1 or self.exponent <= 1.0 or self.offset < 0 or self.mean_extra_words < 0:
            raise ValueError(f"{self}: needs vocabulary >= 1, exponent > 1, offset >= 0, mean_extra_words >= 0")

    def files(self) -> list[tuple[str, int]]:
        """(path relative to the root, sentences) of every file, training files first."""
        train = max(1, round(TRAIN_SENTENCES_PER_FILE * self.scale))
        heldout = max(1, round(HELDOUT_SENTENCES_PER_FILE * self.scale))
        return [(f"{published.LM1B_TRAIN_DIR}/{name}", train) for name in published.LM1B_TRAIN_FILES] + [
            (f"{published.LM1B_HELDOUT_DIR}/{name}", heldout) for name in HELDOUT_FILES
        ]


def sample_ranks(shape: CorpusShape, size: int, generator: np.random.Generator) -> np.ndarray:
    """``size`` word ranks (0-based, int64) of the Zipf-Mandelbrot law of ``shape``, by inverting its tail
    function: rank = floor(((1 + q)^(1-s) - u ((1 + q)^(1-s) - (V + 1 + q)^(1-s)))^(1 / (1-s)) - q) - 1."""
    power = 1.0 - shape.exponent
    top = (1.0 + shape.offset) ** power
    bottom = (shape.vocabulary + 1.0 + shape.offset) ** power
    uniform = generator.random(size)
    ranks = np.floor((top - uniform * (top - bottom)) ** (1.0 / power) - shape.offset).astype(np.int64) - 1
    return np.clip(ranks, 0, shape.vocabulary - 1, out=ranks)


def spell_words(ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The words of ``ranks`` (0-based) as (their bytes, each word followed by one space, as uint8; the start of
    each word in it). See the module docstring for the spelling."""
    ranks = np.asarray(ranks, dtype=np.int64)
    base = len(DIGITS)
    # Bijective base 21: the ranks [first(c), first(c + 1)) are spelt with c digits, the first of them as 0...0.
    digits = np.ones(len(ranks), dtype=np.int64)
    offsets = np.zeros(len(ranks), dtype=np.int64)
    first, width = base, base
    while (longer := ranks >= first).any():
        digits += longer
        offsets[longer] = first
        width *= base
        first += width
    # Letters wanted: grows with log(rank) (2 to 3 for the frequent words, 8 or more for rare ones), jittered.
    mixed = (ranks * 2654435761 + 97) % (1 << 32)
    wanted = np.floor(0.4 + 0.45 * np.log2(ranks + 2.0) + (mixed % 3) * 0.5).astype(np.int64)
    vowels = np.clip(wanted - digits, 0, None)
    max_digits, max_vowels = int(digits.max(initial=1)), int(vowels.max(initial=0))
    # Letter grid: digit j in column 2j, vowel k in column 2k + 1 while the word has a digit k, later vowels in
    # the columns after the last digit's; 0 marks an empty cell.
    columns = 2 * max_digits + max(0, int((vowels - digits).max(initial=0)))
    grid = np.zeros((len(ranks), columns), dtype=np.uint8)
    remainder = ranks - offsets
    for j in range(max_digits - 1, -1, -1):
        present = np.flatnonzero(j < digits)
        grid[present, 2 * j] = DIGITS[remainder[present] % base]
        remainder[present] //= base
    for k in range(max_vowels):
        rows = np.flatnonzero(k < vowels)
        column = np.where(k < digits[rows], 2 * k + 1, 2 * max_digits + k - digits[rows])
        grid[rows, column] = VOWELS[(mixed[rows] >> (3 + 2 * k)) % len(VOWELS)]
    # One type in 50 spells its first vowel (column 1: every word has a digit 0) as the two bytes of é.
    accented = ((mixed >> 20) % 50 == 0) & (vowels > 0)
    cells = np.zeros((len(ranks), columns + 2), dtype=np.uint8)
    cells[:, 0] = grid[:, 0]
    cells[:, 1] = np.where(accented, ACCENT[0], grid[:, 1])
    cells[:, 2] = np.where(accented, ACCENT[1], 0)
    cells[:, 3 : columns + 1] = grid[:, 2:]
    cells[:, columns + 1] = ord(" ")
    filled = cells != 0
    lengths = filled.sum(axis=1)
    return cells[filled], np.cumsum(lengths) - lengths


_spelt: tuple[int, np.ndarray, np.ndarray] | None = None  # (vocabulary, table, starts) of this process


def _words_of(shape: CorpusShape, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(table, word starts, index of each rank's word) for ``ranks``: the words of the distinct ranks for a
    small sample, else every rank's word, spelt once per process (a 1.5-second job for 2M ranks)."""
    global _spelt
    if len(ranks) < shape.vocabulary:
        distinct, position = np.unique(ranks, return_inverse=True)
        return *spell_words(distinct), position
    if _spelt is None or _spelt[0] != shape.vocabulary:
        _spelt = (shape.vocabulary, *spell_words(np.arange(shape.vocabulary)))
    return _spelt[1], _spelt[2], ranks


def file_text(shape: CorpusShape, file_index: int, sentences: int) -> tuple[bytes, int]:
    """The bytes of one file (``sentences`` lines) and its number of words."""
    generator = np.random.default_rng([shape.seed, file_index])
    words_per_sentence = 1 + generator.poisson(shape.mean_extra_words, size=sentences)
    ranks = sample_ranks(shape, int(words_per_sentence.sum()), generator)
    table, word_starts, position = _words_of(shape, ranks)
    word_lengths = np.diff(np.append(word_starts, len(table)))  # with the space
    lengths = word_lengths[position]
    ends = np.cumsum(lengths)
    index = np.repeat(word_starts[position] - (ends - lengths), lengths) + np.arange(int(ends[-1]))
    text = table[index]
    text[ends[np.cumsum(words_per_sentence) - 1] - 1] = ord("\n")
    return text.tobytes(), len(ranks)


def _write_file(task: tuple[CorpusShape, str, int, int, str]) -> tuple[str, int, int, int]:
    shape, relative, file_index, sentences, root = task
    data, words = file_text(shape, file_index, sentences)
    path = Path(root) / relative
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(data)
    partial.replace(path)
    return relative, len(data), sentences, words


def write_corpus(output: str | Path, shape: CorpusShape, workers: int = 1, progress: bool = True) -> dict:
    """Write the corpus under ``output/{ROOT_NAME}``; returns its statistics (also written as
    ``synthetic.json`` beside the two folders)."""
    root = Path(output) / ROOT_NAME
    for directory in (published.LM1B_TRAIN_DIR, published.LM1B_HELDOUT_DIR):
        (root / directory).mkdir(parents=True, exist_ok=True)
    tasks = [
        (shape, relative, index, sentences, str(root)) for index, (relative, sentences) in enumerate(shape.files())
    ]
    started = time.perf_counter()
    totals = {"train": [0, 0, 0], "heldout": [0, 0, 0]}  # bytes, sentences, words
    if workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(workers)
        results = pool.imap(_write_file, tasks)
    else:
        pool, results = None, map(_write_file, tasks)
    try:
        for relative, size, sentences, words in tqdm(
            results,
            total=len(tasks),
            unit="file",
            desc="writing",
            file=sys.stderr,
            disable=not progress,
            dynamic_ncols=True,
        ):
            part = totals["train" if relative.startswith(published.LM1B_TRAIN_DIR) else "heldout"]
            part[0] += size
            part[1] += sentences
            part[2] += words
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    statistics = {
        "root": str(root),
        "shape": dataclasses.asdict(shape),
        "seconds": round(time.perf_counter() - started, 2),
        **{
            f"{part}_{name}": value
            for part, values in totals.items()
            for name, value in zip(("bytes", "sentences", "words"), values)
        },
    }
    (root / "synthetic.json").write_text(json.dumps(statistics, indent=1) + "\n", encoding="utf-8")
    return statistics


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        name="synthetic_lm1b",
        prog="python -m benchmarks.corpora.synthetic_lm1b",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output", required=True, type=Path, help=f"directory to hold {ROOT_NAME}/")
    parser.add_argument("--scale", type=float, default=1.0, help="1.0: the full corpus (0.8B training tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocabulary", type=int, default=CorpusShape.vocabulary, help="ranks of the word law")
    parser.add_argument("--workers", type=int, default=1, help="processes writing files")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    try:
        shape = CorpusShape(scale=args.scale, seed=args.seed, vocabulary=args.vocabulary)
    except ValueError as error:
        parser.error(str(error))
    try:  # a file, a dangling link or a read-only folder in the way: one line, before any work
        ensure_directory(args.output)
    except OSError as error:
        print_error("synthetic_lm1b", describe_os_error(error))
        raise SystemExit(os_error_status(error)) from None
    statistics = write_corpus(args.output, shape, args.workers, args.progress)
    print(
        f"synthetic_lm1b: {statistics['train_sentences']:,} training sentences, {statistics['train_words']:,} words, "
        f"{statistics['train_bytes'] / 1e9:.2f} GB (+ {statistics['heldout_bytes'] / 1e6:.1f} MB heldout) in "
        f"{statistics['root']}, {statistics['seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "synthetic_lm1b"))
