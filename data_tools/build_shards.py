"""Tokenise a raw corpus into deterministic webdataset shards (format: `txl_dist.data.format`).

    # your own text: one document per line (also: --doc-per file | blank-line; .gz and .jsonl inputs)
    python -m data_tools.build_shards --tokenizer tok/ --output shards/ \\
        --split train='corpus/train-*.txt.gz' --split valid=corpus/valid.txt --workers 8

    # a validation split drawn from the training documents by a hash of each document
    python -m data_tools.build_shards --tokenizer tok/ --output shards/ --split train='docs/*.jsonl' \\
        --jsonl-field text --holdout valid=0.01

    # One Billion Word (the r13output directory) and the Penn Treebank (the `treebank` package, or --input DIR)
    python -m data_tools.build_shards --tokenizer tok_lm1b/ --output lm1b/ --format lm1b \\
        --input 1-billion-word-language-modeling-benchmark-r13output --workers 16
    python -m data_tools.build_shards --tokenizer tok_ptb/ --output ptb/ --format ptb

    # the paper's other benchmarks, from the files as downloaded (a byte / character / word tokenizer)
    python -m data_tools.build_shards --tokenizer tok_enwik8/ --output enwik8/ --format enwik8 --input enwik8.zip
    python -m data_tools.build_shards --tokenizer tok_text8/ --output text8/ --format text8 --input text8.zip
    python -m data_tools.build_shards --tokenizer tok_wt103/ --output wt103/ --format wikitext --input wikitext-103/
    # shards to fine-tune a model on (train.init_from): its export folder's tokenizer (tokenizer/ inside it)
    python -m data_tools.build_shards --tokenizer exports/wt103_authors --output mine/ --split train=mine.txt

    # continue an interrupted build (each finished shard is checked by its sha256)
    python -m data_tools.build_shards ... --resume

Documents. A document's tokens are followed by the tokenizer's ``eod_id`` (lines inside a multi-line document
end with ``eos_id``; see `txl_dist.tokenizer`), so a one-sentence-per-line corpus becomes each sentence followed
by one separator. Documents of nothing but whitespace are skipped and counted; bytes that are not UTF-8 become
U+FFFD and are counted, or with ``--strict`` stop the build with the file and byte offset. ``--holdout NAME=F``
sends a training document to split NAME when its 64-bit BLAKE2b hash (of its lines joined by ``\n``, in UTF-8,
read little-endian) is below F * 2**64: the same document always lands in the same split.

How it works. The parent process reads chunks of whole documents (`data_tools.corpora.chunking.read_chunks`),
``--workers`` processes decode and tokenise them, the parent and ``--workers - 1`` spawned ones (the tokenizer is
loaded once per worker; `data_tools.workers.ordered_map`: results in input order, up to 16 unanswered chunks per
spawned worker, so that none runs dry while the parent writes; the parent takes a chunk when they are all busy), and
the parent packs the documents into blocks and blocks into shards. With ``--workers 1`` all of it runs in one
process, and so does a source of fewer than 32 chunks (32 MB with the default ``--chunk-bytes``). With a word
tokenizer, plain one-document-per-line text is tokenised with numpy (`txl_dist.word_scan`; the same tokens as the
str path, three times faster). Which documents share a block depends only on the documents' token counts: a document
that does not fit in what is left of the current block starts the next one, and a document longer than a block spans
as many blocks as it needs (the next documents join its last block). The shards are therefore byte-identical for any
``--workers``.

Character data. With a byte or character tokenizer (`txl_dist.tokenizer`: ``byte``, ``char``) nothing is replaced or
dropped on any path: with one document per line every line of the input is a document, blank ones included, and a
split's tokens are exactly its bytes (characters), newlines and ``\r`` included, and one newline more when the input
ends inside a line (the authors' final ``<eos>``); with ``--holdout`` each line goes whole to one split or the
other; ``--doc-per blank-line`` keeps the blank lines with the paragraph before them and ``--doc-per file`` keeps
the whole file; a ``.jsonl`` record is its text field (see `data_tools.corpora.character_documents`). A char
tokenizer stops at invalid UTF-8 or a character outside its alphabet, naming the file, byte offset and line.
``--format enwik8|text8`` cut the one file (or the file inside its zip, whose CRC-32 is checked over the whole
member first: `data_tools.corpora.zip_member`) at the authors' byte offsets
(`data_tools.corpora.published.held_out_tail_ranges`: 90M / 5M / 5M of 100M; text8's parts stripped of their end
spaces as prep_text8.py does); a zip saved under the raw name, and a folder holding both the file and its zip, are
refused, and the summary line names the file read. ``--format wikitext`` reads ``wiki.*.tokens`` and keeps every
line as a document, so each line, blank or not, ends with one ``<eos>``, as in the authors' data. A flag that the
chosen format or tokenizer does not read (``--held-out-bytes`` without enwik8|text8, ``--lm1b-valid`` without lm1b,
``--jsonl-field`` without a .jsonl input, ``--strict`` with a byte tokenizer) is refused.

Resume. After each finished shard the builder journals, in ``OUT/.build_state.json`` (written atomically), the
shards written so far, where in the input each split continues, and the sha256 of the input bytes the finished
shards were read from (`data_tools.shards.input_digests`). ``--resume`` refuses an input that changed there (even
one byte at the same size), checks each journaled shard's sha256, re-reads the input from the earliest place any
split continues from (documents that a split already holds are read again but not tokenised) and writes the
remaining shards. ``manifest.json`` is written only when every split is complete, and not at all when a split has no
document (an empty input is an error unless ``--allow-empty``). A write failure (no space, read-only output) is one
line naming the file; the partial shard is removed and the finished ones stay for ``--resume``.

Exit status: 0 done; 2 a refused command line or input (one line naming the flag or file); 1 a failure of the
machine (no space, a read-only output, a worker that died); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from data_tools.command_line import FAILURE, INTERRUPTED, USAGE_ERROR, OneLineParser
from data_tools.corpora import chunking, published
from data_tools.corpora.inputs import InputFile, input_files
from data_tools.errors import InputError
from data_tools.shards.builder import build_shards
from data_tools.shards.journal import STATE_NAME
from data_tools.shards.settings import (
    DEFAULT_TOKENS_PER_BLOCK,
    DEFAULT_TOKENS_PER_SHARD,
    BuildSettings,
    Holdout,
)
from data_tools.workers import WorkerError
from txl_dist.data.format import ManifestError
from txl_dist.exit_status import os_error_status, run_command
from txl_dist.fileio import describe_os_error, read_json
from txl_dist.tokenizer import TokenizerError, tokenizer_dir_of

# STATE_NAME: the journal that --resume reads, a file a user of this command sees in the output.
__all__ = ["STATE_NAME", "benchmark_sources", "main", "parse_args", "settings_from_args"]


def _parse_split(text: str) -> tuple[str, list[str]]:
    name, equals, patterns = text.partition("=")
    if not equals or not name or not patterns:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=GLOB[,GLOB...], e.g. train='data/*.txt'")
    return name, [p for p in patterns.split(",") if p]


def _parse_holdout(text: str) -> Holdout:
    name, equals, fraction = text.partition("=")
    try:
        return Holdout(name, float(fraction))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=FRACTION, e.g. valid=0.01") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        name="build_shards",
        prog="python -m data_tools.build_shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_arguments(parser)
    _add_build_arguments(parser)
    return parser.parse_args(argv)


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """What is tokenised, and how it is read."""
    parser.add_argument(
        "--tokenizer",
        required=True,
        type=Path,
        help="tokenizer directory (data_tools.train_tokenizer), or a folder with one in tokenizer/: an export "
        "folder (a model to fine-tune), a training run",
    )
    parser.add_argument("--output", required=True, type=Path, help="directory for the shards and manifest.json")
    parser.add_argument(
        "--format",
        choices=published.FORMATS,
        default="text",
        help="text: --split NAME=GLOB inputs; lm1b: the One Billion Word r13output directory "
        "(--input); ptb: the Penn Treebank (--input DIR, or the treebank package)",
    )
    parser.add_argument(
        "--split",
        action="append",
        type=_parse_split,
        default=[],
        metavar="NAME=GLOB[,GLOB]",
        help="a split and its input files (text/.gz/.jsonl); repeat for more splits",
    )
    parser.add_argument(
        "--input",
        type=Path,
        help="the corpus directory for --format lm1b|ptb|wikitext; the file, "
        "its zip or their directory for --format enwik8|text8",
    )
    parser.add_argument(
        "--held-out-bytes",
        type=int,
        help="--format enwik8|text8: bytes of valid and of test at the end of the file (the "
        f"authors' {published.HELD_OUT_BYTES:,}; smaller for a scaled-down copy)",
    )
    parser.add_argument(
        "--lm1b-valid",
        help="--format lm1b: heldout file used as the valid split (never the test file heldout-00000; default "
        f"{published.LM1B_DEFAULT_VALID_FILE})",
    )
    parser.add_argument(
        "--holdout",
        type=_parse_holdout,
        action="append",
        default=[],
        metavar="NAME=FRACTION",
        help="draw split NAME from the train documents by a hash of each document (once per build)",
    )
    parser.add_argument(
        "--doc-per", choices=chunking.DOC_UNITS, help="what a document is in text inputs (default: line)"
    )
    parser.add_argument("--jsonl-field", help="field of a .jsonl record that holds the document (default: text)")
    parser.add_argument("--strict", action="store_true", help="fail on non-UTF-8 bytes instead of replacing them")


def _add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """How the shards are cut and written."""
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenising processes, this one included (it takes a chunk when the others are busy)",
    )
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        default=DEFAULT_TOKENS_PER_BLOCK,
        help="most tokens of a block (one webdataset sample)",
    )
    parser.add_argument(
        "--tokens-per-shard",
        type=int,
        default=DEFAULT_TOKENS_PER_SHARD,
        help="a shard is closed after the block that reaches this many tokens",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        help=f"bytes of text per unit of work sent to a worker (default {chunking.DEFAULT_CHUNK_BYTES:,}; with "
        "--doc-per file a unit is a whole file)",
    )
    parser.add_argument("--resume", action="store_true", help="continue an interrupted build in --output")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards of a previous build in --output")
    parser.add_argument(
        "--allow-empty",
        action="store_true",
        help="write the manifest even when a split has no document (otherwise an error)",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def settings_from_args(args: argparse.Namespace) -> BuildSettings:
    if len(args.holdout) > 1:
        given = ", ".join(f"{h.split}={h.fraction}" for h in args.holdout)
        raise InputError(
            f"--holdout is given {len(args.holdout)} times ({given}): a build draws one held-out split; "
            f"give the other splits their own inputs (--split NAME=GLOB)"
        )
    _refuse_flags_of_other_formats(args)
    if args.format == "text":
        if args.input is not None:
            raise InputError("--input is for --format lm1b|ptb|wikitext|enwik8|text8; give text inputs with --split")
        sources: dict[str, list[InputFile]] = {}
        for name, patterns in args.split:
            sources.setdefault(name, []).extend(input_files(patterns))
    else:
        if args.split:
            raise InputError(f"--split is for --format text; --format {args.format} defines train/valid/test")
        if args.doc_per not in (None, "line"):
            raise InputError(f"--doc-per {args.doc_per}: --format {args.format} has one sentence per line")
        if args.format == "lm1b":
            if args.input is None:
                raise InputError("--format lm1b needs --input DIR (the r13output directory)")
            sources = published.lm1b_splits(args.input, args.lm1b_valid or published.LM1B_DEFAULT_VALID_FILE)
        elif args.format in ("enwik8", "text8", "wikitext"):
            held_out = published.HELD_OUT_BYTES if args.held_out_bytes is None else args.held_out_bytes
            sources = benchmark_sources(args.format, args.input, held_out)
        else:
            sources = published.ptb_splits(args.input)
    files = [f for split_files in sources.values() for f in split_files]
    if args.jsonl_field is not None and not any(f.jsonl for f in files):
        raise InputError(f"--jsonl-field {args.jsonl_field}: no input is a .jsonl file (nothing reads a field)")
    if args.doc_per is not None and files and all(f.jsonl for f in files):
        raise InputError(f"--doc-per {args.doc_per}: every input is .jsonl, whose records are the documents")
    if args.chunk_bytes is not None and args.doc_per == "file":
        raise InputError(f"--chunk-bytes {args.chunk_bytes}: with --doc-per file each file is one unit of work")
    return BuildSettings(
        tokenizer_directory=tokenizer_dir_of(args.tokenizer).resolve(),
        sources=sources,
        input_format=args.format,
        doc_unit=args.doc_per or "line",
        jsonl_field=args.jsonl_field or "text",
        strict=args.strict,
        holdout=args.holdout[0] if args.holdout else None,
        tokens_per_block=args.tokens_per_block,
        tokens_per_shard=args.tokens_per_shard,
        chunk_bytes=chunking.DEFAULT_CHUNK_BYTES if args.chunk_bytes is None else args.chunk_bytes,
    )


def _refuse_flags_of_other_formats(args: argparse.Namespace) -> None:
    """A flag that the chosen --format does not read is an error, not silently ignored."""
    for flag, value, formats in (
        ("--held-out-bytes", args.held_out_bytes, published.CHARACTER_FORMATS),
        ("--lm1b-valid", args.lm1b_valid, ("lm1b",)),
    ):
        if value is not None and args.format not in formats:
            allowed = "|".join(formats)
            raise InputError(f"{flag} {value}: applies to --format {allowed} only, not to --format {args.format}")


def benchmark_sources(input_format: str, path: Path | None, held_out_bytes: int) -> dict[str, list[InputFile]]:
    """The splits of ``--format enwik8|text8|wikitext`` (see `data_tools.corpora.published`)."""
    if path is None:
        what = (
            "the folder of wiki.*.tokens"
            if input_format == "wikitext"
            else f"{input_format}, {input_format}.zip or their folder"
        )
        raise InputError(f"--format {input_format} needs --input ({what})")
    if input_format == "wikitext":
        return published.wikitext_splits(path)
    splits = published.enwik8_splits if input_format == "enwik8" else published.text8_splits
    return splits(path, held_out_bytes)


def _what_an_interrupt_left(output: Path) -> str:
    """What an interrupted build leaves in ``output``, as its journal says, and how to go on from there."""
    journal = output / STATE_NAME
    if not journal.is_file():
        return "interrupted before anything was written (no shard, no journal): nothing to resume; run it again"
    try:
        finished = sum(len(stream["shards"]) for stream in read_json(journal)["streams"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        finished = 0  # a journal --resume will refuse in its own words
    if not finished:
        return f"interrupted before the first shard was finished ({journal} is kept): rerun with --resume"
    return f"interrupted; the finished shards are kept ({finished} in {output}, with {journal}): rerun with --resume"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
        summary = build_shards(
            settings,
            args.output,
            workers=args.workers,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=args.progress,
            allow_empty=args.allow_empty,
        )
    except (InputError, TokenizerError, ManifestError) as error:
        print(f"build_shards: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except WorkerError as error:
        print(f"build_shards: error: {error}", file=sys.stderr)
        return FAILURE
    except OSError as error:  # no space, a read-only output (1); a file where a folder should be (2)
        print(f"build_shards: error: {describe_os_error(error)}", file=sys.stderr)
        return os_error_status(error)
    except KeyboardInterrupt:
        print(f"build_shards: {_what_an_interrupt_left(args.output)}", file=sys.stderr)
        return INTERRUPTED
    print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "build_shards"))
