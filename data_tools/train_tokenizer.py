"""Train a tokenizer on a raw corpus: SentencePiece (unigram or BPE) or whitespace-separated words.

    # SentencePiece on your own corpus (any size: --input-sentence-size sentences are sampled for training)
    python -m data_tools.train_tokenizer --kind sentencepiece --input 'corpus/*.txt.gz' --output tok/ \\
        --vocab-size 32000 --model-type unigram --eod-symbol '<eod>'

    # the Penn Treebank's 10,000 words (its text already holds <unk>), from the treebank package
    python -m data_tools.train_tokenizer --kind word --format ptb --output tok_ptb/

    # the One Billion Word vocabulary of the paper: the words of the 99 training files seen at least 3 times,
    # plus <S>, </S> (the sentence separator) and <UNK>; counted by 8 processes
    python -m data_tools.train_tokenizer --preset lm1b --format lm1b \\
        --input 1-billion-word-language-modeling-benchmark-r13output --output tok_lm1b/ --workers 8

    # the paper's character and WikiText benchmarks, from the files as downloaded: every byte of enwik8 one
    # id; text8's 27 characters and the newline; WikiText-103's 267,735 train words with <eos>
    python -m data_tools.train_tokenizer --preset enwik8 --format enwik8 --input enwik8.zip --output tok_enwik8/
    python -m data_tools.train_tokenizer --preset text8 --format text8 --input text8.zip --output tok_text8/
    python -m data_tools.train_tokenizer --preset wikitext --format wikitext --input wikitext-103/ --output tok_wt103/

The output directory holds the tokenizer's file (``spm.model``, ``vocab.txt``, ``bytes.txt`` or ``chars.txt``) and
``tokenizer.json``; load it with `txl_dist.tokenizer.load_tokenizer`. Only the training split of --format lm1b|ptb
is read. An input without a document (empty or blank files) is an error, before anything is written, unless
--allow-empty (a word vocabulary of the special symbols only). A write failure (read-only or full output) is one
line naming the file. The tokenizer is written into a staging folder inside --output and moved into place when it
is complete, so that an error or Ctrl-C leaves --output as it was (a tokenizer there with --overwrite included)
and removes a folder this run created. A flag that the chosen kind or format does not read (``--vocab-size``
without sentencepiece, ``--min-count`` without word, ``--alphabet`` without char, ``--held-out-bytes`` without
enwik8|text8, ``--doc-per`` or ``--strict`` for a byte tokenizer, ...) is refused, as is a damaged zip member
(its CRC-32 is checked over the whole member, see `data_tools.corpora.zip_member`). Byte and char tokenizers read every
byte (character) of a plain input and the text field of a .jsonl input's records. Exit status: 0 done; 2 a
refused command line or input (one line naming the flag or file); 1 a failure of the machine (no space, a
read-only output); 130 interrupted.

Words are counted by ``--workers`` processes, each over the chunks it is given (with numpy for plain
one-document-per-line text, see `txl_dist.word_scan`), handing its totals over once at the end; the vocabulary does
not depend on their number. SentencePiece skips every training sentence longer than its ``max_sentence_length``
(4,192 bytes) without a word; here a longer line is first cut into pieces that fit (at sentence ends, else at
whitespace: `data_tools.vocabularies.sentencepiece.training_pieces`), so that documents of one long line count too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data_tools.command_line import (
    INTERRUPTED,
    OneLineParser,
    describe_inputs,
    flag_name,
    given_flags,
)
from data_tools.corpora import chunking, published
from data_tools.corpora.inputs import TREEBANK_PREFIX, InputFile, input_files
from data_tools.errors import InputError
from data_tools.vocabularies.lists import train_byte, train_char, train_word
from data_tools.vocabularies.reading import Reading
from data_tools.vocabularies.sentencepiece import DEFAULT_MAX_SENTENCE_LENGTH, train_sentencepiece
from txl_dist.exit_status import exit_status, run_command
from txl_dist.fileio import describe_os_error
from txl_dist.output_folders import OutputPathError, refuse_output_over_inputs
from txl_dist.tokenizer import (
    BYTE_VOCAB,
    CHAR_VOCAB,
    KINDS,
    SENTENCEPIECE_MODEL,
    TOKENIZER_JSON,
    WORD_VOCAB,
    Tokenizer,
    TokenizerError,
)

TEXT8_ALPHABET = " abcdefghijklmnopqrstuvwxyz"
PRESETS: dict[str, dict[str, Any]] = {
    # Chelba et al. (2013): words of the training data with count >= 3, 793,471 entries with <S>, </S>, <UNK>.
    "lm1b": {"kind": "word", "min_count": 3, "specials": ["<S>", "</S>", "<UNK>"], "eos": "</S>", "unk": "<UNK>"},
    # The authors' enwik8 symbols are its bytes; here every byte value has an id, the newline included.
    "enwik8": {"kind": "byte"},
    # text8: lower-case letters and the space (the authors write it as '_'), plus the newline that ends a line.
    "text8": {"kind": "char", "alphabet": TEXT8_ALPHABET},
    # WikiText: every word of the training file (it already holds <unk>), <eos> first: 267,735 for WT103.
    "wikitext": {"kind": "word", "min_count": 1, "specials": ["<eos>"], "eos": "<eos>", "unk": "<unk>"},
}
OWN_FILES = (TOKENIZER_JSON, SENTENCEPIECE_MODEL, "spm.vocab", WORD_VOCAB, BYTE_VOCAB, CHAR_VOCAB)
STAGING_PREFIX = ".train_tokenizer.partial-"
"""The folder inside --output where a run writes its tokenizer before moving it in (the name ends in its pid)."""


def _training_files(args: argparse.Namespace) -> list[InputFile]:
    if args.format == "text":
        if not args.input:
            raise InputError("--input: give the training files (paths or glob patterns)")
        return input_files([str(p) for p in args.input])
    if args.doc_per not in (None, "line"):
        raise InputError(f"--doc-per {args.doc_per}: --format {args.format} has one sentence per line")
    if len(args.input or []) > 1:
        raise InputError(f"--format {args.format} takes one --input directory")
    directory = args.input[0] if args.input else None
    if args.format == "lm1b":
        if directory is None:
            raise InputError("--format lm1b needs --input DIR (the r13output directory)")
        return published.lm1b_splits(directory)["train"]
    if args.format in ("enwik8", "text8", "wikitext"):
        if directory is None:
            raise InputError(f"--format {args.format} needs --input (the file as downloaded, or its folder)")
        if args.format == "wikitext":
            return published.wikitext_splits(directory)["train"]
        splits = published.enwik8_splits if args.format == "enwik8" else published.text8_splits
        held_out = published.HELD_OUT_BYTES if args.held_out_bytes is None else args.held_out_bytes
        return splits(directory, held_out)["train"]
    return published.ptb_splits(directory)["train"]


def _prepare_output(output: Path, overwrite: bool) -> Path:
    """Check the output folder (creating it) and make the staging folder inside it where the tokenizer is written.
    Nothing of a tokenizer already in the folder is touched before the new one is complete (`_install`)."""
    if output.exists() and not output.is_dir():
        raise InputError(f"{output}: exists and is not a directory")
    output.mkdir(parents=True, exist_ok=True)
    for path in output.iterdir():  # left by a run that was killed (a Ctrl-C removes its own)
        if _stale_staging(path.name):
            shutil.rmtree(path)
    entries = sorted(p.name for p in output.iterdir())
    if entries and not overwrite:
        raise InputError(f"{output}: not empty ({', '.join(entries[:3])}); pass --overwrite to replace the tokenizer")
    staging = output / f"{STAGING_PREFIX}{os.getpid()}"
    staging.mkdir()
    return staging


def _stale_staging(name: str) -> bool:
    """Whether ``name`` is the staging folder of a run whose process is gone."""
    pid = name.removeprefix(STAGING_PREFIX)
    if pid == name or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _install(staging: Path, output: Path) -> None:
    """Move the tokenizer from ``staging`` into ``output``, replacing the files of the one there, with Ctrl-C held
    back until it is done: tokenizer.json goes first (the folder is no tokenizer meanwhile) and comes back last."""
    new = sorted(p.name for p in staging.iterdir())
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        (output / TOKENIZER_JSON).unlink(missing_ok=True)
        for name in OWN_FILES:
            if name not in new:
                (output / name).unlink(missing_ok=True)
        for name in [n for n in new if n != TOKENIZER_JSON] + [TOKENIZER_JSON]:
            os.replace(staging / name, output / name)
        staging.rmdir()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _clean_up(output: Path, staging: Path | None, created: bool) -> None:
    """Remove what a run that stops leaves: its staging folder, and the output folder when this run created it."""
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    if created and output.is_dir() and not any(output.iterdir()):
        try:
            output.rmdir()
        except OSError:  # another process put a file there meanwhile: not ours to remove
            pass


# The flags each kind of tokenizer reads; given to another kind, they are refused rather than ignored.
KIND_FLAGS = {
    "sentencepiece": (
        "vocab_size",
        "model_type",
        "character_coverage",
        "input_sentence_size",
        "seed",
        "max_sentence_length",
        "user_symbols",
        "eod_symbol",
        "threads",
    ),
    "word": ("min_count", "max_size", "specials", "eos", "eod", "unk", "workers"),
    "char": ("alphabet",),
}


def _refuse_flags_that_do_not_apply(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set) -> None:
    """A flag given on the command line that the chosen kind and format do not read is an error."""
    if args.kind == "sentencepiece" and "workers" in given:
        raise InputError(
            f"--workers {args.workers}: only --kind word counts in processes; sentencepiece trains with --threads"
        )
    for kind, flags in KIND_FLAGS.items():
        for dest in sorted(given & set(flags)):
            if args.kind != kind:
                raise InputError(f"{flag_name(parser, dest)}: applies to --kind {kind} only, not to --kind {args.kind}")
    if "held_out_bytes" in given and args.format not in published.CHARACTER_FORMATS:
        raise InputError(
            f"--held-out-bytes {args.held_out_bytes}: applies to --format enwik8|text8 only, not to --format "
            f"{args.format}"
        )
    if args.kind in ("byte", "char") and "doc_per" in given:
        raise InputError(
            f"--doc-per {args.doc_per}: a {args.kind} tokenizer's vocabulary does not depend on what a document "
            f"is; give --doc-per to build_shards"
        )
    if args.kind == "sentencepiece" and args.allow_empty:
        raise InputError("--allow-empty: a sentencepiece model cannot be trained on an empty input")
    if args.kind == "byte" and args.strict:
        raise InputError("--strict: a byte tokenizer keeps every byte, those that are not UTF-8 too; drop --strict")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return _parser(argv).parse_args(argv)


def _parser(argv: Sequence[str] | None) -> argparse.ArgumentParser:
    """The command line's parser, with the defaults of the --preset that ``argv`` names."""
    parser = OneLineParser(
        name="train_tokenizer",
        prog="python -m data_tools.train_tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="named settings (flags given still win)")
    parser.add_argument("--kind", choices=KINDS)
    parser.add_argument(
        "--input",
        nargs="+",
        help="text/.gz/.jsonl files or glob patterns; for --format "
        "lm1b|ptb the corpus directory (ptb: optional, default the treebank package)",
    )
    parser.add_argument("--format", choices=published.FORMATS, default="text")
    parser.add_argument(
        "--doc-per", choices=chunking.DOC_UNITS, help="what a document is in text inputs (default: line)"
    )
    parser.add_argument("--jsonl-field", default="text", help="field of a .jsonl record that holds the document")
    parser.add_argument("--strict", action="store_true", help="fail on non-UTF-8 bytes instead of replacing them")
    parser.add_argument("--output", required=True, type=Path, help="the tokenizer directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --output")
    parser.add_argument(
        "--allow-empty", action="store_true", help="accept an input without any document (otherwise an error)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="--kind word: processes counting words, this one included (the vocabulary is the same for any number)",
    )
    _add_kind_arguments(parser)
    preset = parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])
    return parser


def _add_kind_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings of each kind of tokenizer (and the held-out bytes that enwik8|text8 training leaves out)."""
    sp = parser.add_argument_group("sentencepiece")
    sp.add_argument("--vocab-size", type=int, default=32000)
    sp.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram")
    sp.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="share of characters the model covers (1.0 for small alphabets)",
    )
    sp.add_argument(
        "--input-sentence-size",
        type=int,
        default=2_000_000,
        help="lines sampled from the input for training (bounds memory and time)",
    )
    sp.add_argument("--seed", type=int, default=0, help="seed of the sampling of --input-sentence-size lines")
    sp.add_argument(
        "--max-sentence-length",
        type=int,
        default=DEFAULT_MAX_SENTENCE_LENGTH,
        help="bytes; longer lines are cut (at sentence ends, else at whitespace) into training pieces",
    )
    sp.add_argument("--user-symbols", nargs="*", default=[], help="pieces never split, e.g. '<eod>'")
    sp.add_argument("--eod-symbol", help="end-of-document user symbol; documents then end with it")
    sp.add_argument(
        "--threads",
        type=int,
        default=8,
        help="training threads; the model depends on their number, so a fixed default keeps training "
        "reproducible across machines",
    )
    parser.add_argument(
        "--held-out-bytes",
        type=int,
        help="--format enwik8|text8: bytes of valid and of test at the end of the file, left out "
        f"of training (the authors' {published.HELD_OUT_BYTES:,}; smaller for a scaled-down copy)",
    )
    char = parser.add_argument_group("char")
    char.add_argument(
        "--alphabet",
        help="the characters of the vocabulary (default: those of the training text); the newline is always id 0",
    )
    word = parser.add_argument_group("word")
    word.add_argument("--min-count", type=int, default=1, help="keep words seen at least this often")
    word.add_argument("--max-size", type=int, help="at most this many entries, specials included")
    word.add_argument("--specials", nargs="+", default=["<eos>"], help="tokens placed first, in this order")
    word.add_argument("--eos", help="the sentence separator (default: the first special)")
    word.add_argument("--eod", help="end-of-document token (default: the separator)")
    word.add_argument("--unk", default="<unk>", help="token for words outside the vocabulary")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser(argv)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    created, staging, installed = False, None, False
    try:
        if args.kind is None:
            raise InputError("--kind: choose sentencepiece, word, byte or char (or a --preset)")
        _refuse_flags_that_do_not_apply(parser, args, given_flags(parser, argv))
        files = _training_files(args)
        if args.jsonl_field != "text" and not any(f.jsonl for f in files):
            raise InputError(f"--jsonl-field {args.jsonl_field}: no input is a .jsonl file (nothing reads a field)")
        if args.doc_per is not None and files and all(f.jsonl for f in files):
            raise InputError(f"--doc-per {args.doc_per}: every input is .jsonl, whose records are the documents")
        try:  # before anything in the output is deleted
            refuse_output_over_inputs(args.output, [f.name for f in files if not f.name.startswith(TREEBANK_PREFIX)])
        except OutputPathError as error:
            raise InputError(str(error)) from None
        created = not args.output.exists()
        staging = _prepare_output(args.output, args.overwrite)
        reading = Reading(files, args.doc_per or "line", args.jsonl_field, args.strict, args.progress, args.allow_empty)
        tokenizer = _train(args, reading, staging)
        _install(staging, args.output)
        installed = True
    except (InputError, TokenizerError, OSError) as error:
        # A refused input leaves no trace: the folder this run created goes again while nothing is in it.
        _clean_up(args.output, staging, created)
        # OSError: a read-only or full output, a file where the folder should be; named by the output's path, as
        # the staging folder's name means nothing to a user.
        message = describe_os_error(error) if isinstance(error, OSError) else str(error)
        if staging is not None:
            message = message.replace(str(staging), str(args.output))
        print(f"train_tokenizer: error: {message}", file=sys.stderr)
        return exit_status(error)  # 2 for a refused input; 1 for an OSError of the surroundings (no space, ...)
    except KeyboardInterrupt:
        if installed:  # the Ctrl-C held back while the tokenizer was moved in
            print(f"train_tokenizer: interrupted; the tokenizer in {args.output} is complete", file=sys.stderr)
        else:
            _clean_up(args.output, staging, created)
            left = "removed again" if created else "left as it was"
            print(f"train_tokenizer: interrupted; nothing written, {args.output} {left}", file=sys.stderr)
        return INTERRUPTED
    statistics = reading.statistics
    print(
        f"train_tokenizer: {tokenizer.kind} tokenizer of {tokenizer.vocab_size:,} entries in {args.output} "
        f"(eos {tokenizer.eos_id}, eod {tokenizer.eod_id}, unk {tokenizer.unk_id}) from {statistics['documents']:,} "
        f"documents, {statistics['lines']:,} lines; {statistics['empty_documents']:,} empty documents skipped, "
        f"{statistics['replaced_bytes']:,} non-UTF-8 bytes replaced; {time.perf_counter() - started:.1f} s; "
        f"read {describe_inputs(files)}"
    )
    return 0


def _train(args: argparse.Namespace, reading: Reading, output: Path) -> Tokenizer:
    """The tokenizer of ``--kind``, trained on ``reading`` and written to ``output``."""
    if args.kind == "byte":
        return train_byte(reading, output)
    if args.kind == "char":
        return train_char(reading, output, args.alphabet)
    if args.kind == "word":
        return train_word(
            reading,
            output,
            args.min_count,
            args.max_size,
            args.specials,
            args.eos,
            args.eod,
            args.unk,
            args.workers,
        )
    return train_sentencepiece(
        reading,
        output,
        args.vocab_size,
        args.model_type,
        args.character_coverage,
        args.input_sentence_size,
        args.user_symbols,
        args.eod_symbol,
        args.seed,
        args.threads,
        args.max_sentence_length,
    )


if __name__ == "__main__":
    sys.exit(run_command(main, "train_tokenizer"))
