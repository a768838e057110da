"""Write synthetic corpora with the layouts and the statistics of enwik8, text8 and WikiText-103.

    # from the repository root (benchmarks/ is not part of the installed package)
    # enwik8's shape: 100,000,000 bytes of XML-like Wikipedia markup, a line every ~90 bytes (and its zip)
    python -m benchmarks.corpora.synthetic_charlm enwik8 --output /tmp/charlm/enwik8 --bytes 100000000 --zip
    # text8's: 100,000,000 characters of lower-case words and single spaces on one line, starting with a space
    python -m benchmarks.corpora.synthetic_charlm text8 --output /tmp/charlm/text8 --bytes 100000000
    # WikiText-103's folder: wiki.{train,valid,test}.tokens, " = Title = " headings, blank lines, <unk>, @-@
    python -m benchmarks.corpora.synthetic_charlm wikitext --output /tmp/charlm/wikitext-103 --train-words 2000000

None of the real files can be downloaded here; these have what the importers depend on, so that
``--format enwik8|text8|wikitext`` of `data_tools.train_tokenizer` and `data_tools.build_shards` read them as
they read the real ones:

- enwik8: a ``<mediawiki>`` dump of ``<page>`` elements (title, id, revision, ``<text xml:space="preserve">``)
  whose text has wiki markup (``[[links]]``, ``'''bold'''``, ``{{templates}}``, ``&quot;`` entities), words
  of a Zipf law with 2-, 3- and 4-byte UTF-8 characters in some of them, and, as the real file, the file cut at
  exactly ``--bytes`` bytes (inside a character, if it falls there: the real enwik8's last bytes are not a whole
  UTF-8 sequence), plus a byte 0xFF in one page in 200 (bytes that are not UTF-8, which the byte path keeps).
  The real file has 205 distinct byte values and a line every 90 bytes or so.
- text8: 27 characters (a-z and the space), one line without a line end, words of a Zipf law over 250k types
  at 100M characters (text8 has 253,854), the first byte a space as in the real file.

Words alternate consonants and vowels, so that a model learns more than the letters' frequencies (a small model
goes from 8 bits per byte to below 4 in minutes on enwik8's layout); they are not English, and bits per character
on these files are not comparable with the real corpora's.
- WikiText: a folder of ``wiki.{train,valid,test}.tokens``: articles of `` = Title = `` and `` = = Section = = ``
  headings between blank lines `` `` and paragraphs of space-separated tokens (``@-@``, ``@,@``, punctuation as
  tokens, ``<unk>`` for rare words); valid and test use only the words of train (as WikiText, whose rare words
  are ``<unk>`` everywhere). WikiText-103 has 103M training tokens in 28,475 articles; ``--train-words`` scales.

Deterministic: the bytes depend on the arguments and the seed alone (the zip's too: its date is fixed). Each file
is written whole or not at all; an existing output is replaced only with ``--overwrite``, and a folder never
stands for a file. Exit status: 0 done, 2 a refused command line (one line naming the flag or path), 1 a failure
of the machine (no space, read-only), 130 interrupted.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_tools.command_line import INTERRUPTED, USAGE_ERROR, OneLineParser, given_flags
from txl_dist.exit_status import os_error_status, run_command
from txl_dist.fileio import atomic_write, describe_os_error

CONSONANTS = np.frombuffer(b"bcdfghjklmnpqrstvwxyz", dtype=np.uint8)
VOWELS = np.frombuffer(b"aeiou", dtype=np.uint8)
# Non-ASCII letters of enwik8's text: 2 bytes (e, a, o with accents), 3 bytes (a dash, CJK), 4 bytes (a symbol).
WIDE_CHARACTERS = ["é", "ö", "ñ", "–", "日", "本", "𝄞"]
MARKUP = [
    b"[[",
    b"]]",
    b"'''",
    b"''",
    b"{{cite web",
    b"|",
    b"}}",
    b"&quot;",
    b"&lt;ref&gt;",
    b"&lt;/ref&gt;",
    b"==",
    b"*",
    b"(",
    b")",
    b",",
    b".",
]


def zipf_words(types: int, generator: np.random.Generator, wide_share: float = 0.0) -> list[bytes]:
    """``types`` distinct lower-case words, frequent ones short (rank r gets ~log(r) letters), spelled in
    syllables of a consonant and a vowel (as text has letter-to-letter structure a model can learn beyond the
    letters' frequencies); a share of them carry one non-ASCII character."""
    words, seen = [], set()
    while len(words) < types:
        rank = len(words) + 1
        length = max(1, int(np.log2(rank + 1) * 0.9 + generator.integers(0, 3)))
        letters = np.empty(length, dtype=np.uint8)
        letters[0::2] = CONSONANTS[generator.integers(0, len(CONSONANTS), size=(length + 1) // 2)]
        letters[1::2] = VOWELS[generator.integers(0, len(VOWELS), size=length // 2)]
        word = letters.tobytes()
        if wide_share and generator.random() < wide_share:
            word += WIDE_CHARACTERS[generator.integers(0, len(WIDE_CHARACTERS))].encode("utf-8")
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


@functools.lru_cache(maxsize=8)
def _zipf_cumulative(types: int, exponent: float) -> np.ndarray:
    weights = (np.arange(types) + 2.0) ** -exponent
    return np.cumsum(weights / weights.sum())


def zipf_ranks(count: int, types: int, generator: np.random.Generator, exponent: float = 1.1) -> np.ndarray:
    """``count`` ranks in [0, types) drawn from a Zipf law P(r) ~ (r + 2)^-exponent."""
    cumulative = _zipf_cumulative(types, exponent)
    return np.minimum(np.searchsorted(cumulative, generator.random(count)), types - 1)


def enwik8_bytes(size: int, seed: int = 0) -> bytes:
    """``size`` bytes in enwik8's layout (see the module docstring)."""
    generator = np.random.default_rng([seed, 8])
    words = zipf_words(30_000, generator, wide_share=0.02)
    vocabulary = np.array(words + MARKUP, dtype=object)
    markup_ids = np.arange(len(words), len(vocabulary))
    parts = [
        b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/" version="0.3" xml:lang="en">\n'
        b"  <siteinfo>\n    <sitename>Wikipedia</sitename>\n  </siteinfo>\n"
    ]
    written, page = len(parts[0]), 0
    while written < size:
        page += 1
        ids = zipf_ranks(int(generator.integers(200, 3000)), len(words), generator)
        markup = generator.random(len(ids)) < 0.08
        ids[markup] = generator.choice(markup_ids, size=int(markup.sum()))
        text = b" ".join(vocabulary[ids].tolist())
        # Lines of ~15 words: a newline replaces the space before about one word in 15.
        spaces = np.flatnonzero(np.frombuffer(text, dtype=np.uint8) == 32)
        breaks = spaces[generator.random(len(spaces)) < 1 / 15]
        text_array = np.frombuffer(text, dtype=np.uint8).copy()
        text_array[breaks] = 10
        if page % 200 == 1:
            text_array[len(text_array) // 2] = 0xFF
        title = b" ".join(vocabulary[zipf_ranks(2, len(words), generator)].tolist()).title()
        chunk = (
            b"  <page>\n    <title>" + title + b"</title>\n    <id>" + str(page).encode() + b"</id>\n"
            b"    <revision>\n      <id>" + str(1000 + page).encode() + b"</id>\n"
            b"      <timestamp>2006-03-01T00:00:00Z</timestamp>\n"
            b'      <text xml:space="preserve">' + text_array.tobytes() + b"</text>\n    </revision>\n  </page>\n"
        )
        parts.append(chunk)
        written += len(chunk)
    return b"".join(parts)[:size]


def text8_bytes(size: int, seed: int = 0) -> bytes:
    """``size`` characters in text8's layout (see the module docstring)."""
    generator = np.random.default_rng([seed, 27])
    # text8 has 253,854 word types in 100M characters; a smaller file gets fewer (one per 400 characters).
    words = np.array(zipf_words(min(250_000, max(2_000, size // 400)), generator), dtype=object)
    parts, written = [], 0
    while written < size:
        ids = zipf_ranks(1_000_000, len(words), generator)
        text = b" " + b" ".join(words[ids].tolist())
        parts.append(text)
        written += len(text)
    return b"".join(parts)[:size]


def wikitext_lines(words: int, vocabulary: Sequence[bytes], generator: np.random.Generator) -> list[bytes]:
    """Lines of WikiText articles holding about ``words`` tokens (see the module docstring)."""
    vocabulary = np.array(list(vocabulary), dtype=object)
    lines: list[bytes] = []
    written = 0
    while written < words:
        title = b" ".join(vocabulary[zipf_ranks(2, len(vocabulary), generator)].tolist()).title()
        lines += [b" ", b" = " + title + b" = ", b" "]
        for section in range(int(generator.integers(1, 5))):
            if section:
                heading = b" ".join(vocabulary[zipf_ranks(1, len(vocabulary), generator)].tolist()).title()
                lines += [b" ", b" = = " + heading + b" = = ", b" "]
            for _ in range(int(generator.integers(1, 4))):
                ids = zipf_ranks(int(generator.integers(40, 200)), len(vocabulary), generator)
                tokens = vocabulary[ids].tolist()
                lines.append(b" " + b" ".join(tokens) + b" ")
                written += len(tokens)
    return lines


def write_wikitext(output: Path, train_words: int, seed: int = 0) -> dict[str, Path]:
    """``wiki.{train,valid,test}.tokens`` in ``output`` (valid and test ~1/40 of train each, as WT103's
    217k/245k tokens against 103M ... 1/40 keeps them large enough to score at small scales). Each file is
    written whole or not at all, test last, and those already there are removed first: an interrupted run leaves
    no folder whose three files the importer would read as one corpus."""
    generator = np.random.default_rng([seed, 103])
    # WikiText-2 has 33k word types in 2M training tokens, WikiText-103 267k in 103M.
    words = zipf_words(min(267_000, max(1000, train_words // 40)), generator, wide_share=0.01)
    vocabulary = words + [b"<unk>", b"@-@", b"@,@", b"@.@", b",", b".", b"(", b")", b'"', b";"]
    train = wikitext_lines(train_words, vocabulary, generator)
    seen = {token for line in train for token in line.split()}
    heldout_vocabulary = [word for word in vocabulary if word in seen]
    output.mkdir(parents=True, exist_ok=True)
    paths = {split: output / f"wiki.{split}.tokens" for split in ("train", "valid", "test")}
    for path in paths.values():
        path.unlink(missing_ok=True)
    for split, lines in (
        ("train", train),
        ("valid", wikitext_lines(max(1000, train_words // 40), heldout_vocabulary, generator)),
        ("test", wikitext_lines(max(1000, train_words // 40), heldout_vocabulary, generator)),
    ):
        data = b"\n".join(lines) + b"\n"
        atomic_write(paths[split], lambda handle, data=data: handle.write(data))
    return paths


def write_character_corpus(kind: str, output: Path, size: int, seed: int = 0, make_zip: bool = False) -> Path:
    """``output`` (enwik8 or text8 layout) of ``size`` bytes, and with ``make_zip`` also ``output.zip`` holding
    it under the name ``kind``, as mattmahoney.net serves them. Returns the file written. Each file is written
    whole or not at all (an old zip is removed first, so that no zip of other bytes stays beside a new file)."""
    data = enwik8_bytes(size, seed) if kind == "enwik8" else text8_bytes(size, seed)
    output.parent.mkdir(parents=True, exist_ok=True)
    archive_path = output.with_name(output.name + ".zip")
    if make_zip:
        archive_path.unlink(missing_ok=True)
    atomic_write(output, lambda handle: handle.write(data))
    if make_zip:

        def write_zip(handle) -> None:
            with zipfile.ZipFile(handle, "w", zipfile.ZIP_DEFLATED) as archive:
                info = zipfile.ZipInfo(kind, date_time=(2006, 3, 1, 0, 0, 0))  # fixed: the same bytes every run
                info.external_attr = 0o644 << 16
                archive.writestr(info, data, zipfile.ZIP_DEFLATED)

        atomic_write(archive_path, write_zip)
    return output


# Sizes past which the file, built in memory, would need more memory than a workstation has: ten times enwik8's
# bytes, twice WikiText-103's training words.
MAX_BYTES = 1_000_000_000
MAX_TRAIN_WORDS = 200_000_000


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        name="synthetic_charlm",
        prog="python -m benchmarks.corpora.synthetic_charlm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("layout", choices=("enwik8", "text8", "wikitext"))
    parser.add_argument("--output", required=True, type=Path, help="the file (enwik8, text8) or folder (wikitext)")
    parser.add_argument("--bytes", type=int, default=100_000_000, help="enwik8/text8: the file's size")
    parser.add_argument("--train-words", type=int, default=2_000_000, help="wikitext: tokens of wiki.train.tokens")
    parser.add_argument("--zip", action="store_true", help="enwik8/text8: also write OUTPUT.zip")
    parser.add_argument("--seed", type=int, default=0, help="a non-negative integer")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an earlier run")
    args = parser.parse_args(argv)
    given = given_flags(parser, argv)
    character = args.layout != "wikitext"
    for flag, dest, applies in (
        ("--bytes", "bytes", character),
        ("--zip", "zip", character),
        ("--train-words", "train_words", not character),
    ):
        if dest in given and not applies:
            parser.error(f"{flag}: does not apply to the {args.layout} layout")
    for flag, value, largest in (
        ("--bytes", args.bytes, MAX_BYTES),
        ("--train-words", args.train_words, MAX_TRAIN_WORDS),
        ("--seed", args.seed, 2**63 - 1),
    ):
        smallest = 0 if flag == "--seed" else 1
        if not smallest <= value <= largest:
            parser.error(f"{flag} {value}: must lie in [{smallest}, {largest:,}]")
    return args


def _refuse_existing_output(args: argparse.Namespace) -> None:
    """An output of an earlier run (or anything else of that name) is replaced only with --overwrite, and a
    folder never stands for a file, nor a file for a folder."""
    output = args.output
    if args.layout == "wikitext":
        if output.exists() and not output.is_dir():
            raise ValueError(f"{output}: exists and is not a directory (the wikitext layout is a folder)")
        targets = [output / f"wiki.{split}.tokens" for split in ("train", "valid", "test")]
    else:
        targets = [output] + ([output.with_name(output.name + ".zip")] if args.zip else [])
    for target in targets:
        if target.is_dir() or (target.is_symlink() and not target.exists()):
            raise ValueError(f"{target}: is a directory or a dangling link; give the path of the file to write")
        if target.exists() and not args.overwrite:
            raise ValueError(f"{target}: exists; pass --overwrite to replace it")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    started = time.perf_counter()
    try:
        _refuse_existing_output(args)
        if args.layout == "wikitext":
            paths = write_wikitext(args.output, args.train_words, args.seed)
            written = ", ".join(f"{p.name} {p.stat().st_size:,} bytes" for p in paths.values())
        else:
            path = write_character_corpus(args.layout, args.output, args.bytes, args.seed, args.zip)
            written = f"{path} {path.stat().st_size:,} bytes" + (" and its .zip" if args.zip else "")
    except ValueError as error:
        print(f"synthetic_charlm: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as error:
        print(f"synthetic_charlm: error: {describe_os_error(error)}", file=sys.stderr)
        return os_error_status(error)
    except KeyboardInterrupt:
        print(f"synthetic_charlm: interrupted; no partial file left in {args.output}", file=sys.stderr)
        return INTERRUPTED
    print(f"synthetic_charlm: {args.layout}: {written} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "synthetic_charlm"))
