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
line naming the file.

Words are counted by ``--workers`` processes, each over the chunks it is given (with numpy for plain
one-document-per-line text, see `txl_dist.word_scan`), handing its totals over once at the end; the vocabulary
does not depend on their number. SentencePiece skips every training sentence longer than its
``max_sentence_length`` (4,192 bytes) without a word; here a longer line is first cut into pieces that fit (at
sentence ends, else at whitespace: `training_pieces`), so that documents of one long line count too.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data_tools import corpus
from data_tools.corpus import InputError, InputFile
from data_tools.workers import WorkerError, ordered_map
from txl_dist import word_scan
from txl_dist.fileio import OutputPathError, atomic_write, describe_os_error, refuse_output_over_inputs
from txl_dist.tokenizer import (
    BYTE_VOCAB,
    CHAR_VOCAB,
    KINDS,
    NEWLINE,
    SENTENCEPIECE_MODEL,
    TOKENIZER_JSON,
    WORD_VOCAB,
    Tokenizer,
    TokenizerError,
    byte_piece,
    char_piece,
    write_tokenizer_json,
    write_word_vocab,
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
DEFAULT_MAX_SENTENCE_LENGTH = 4192  # bytes: SentencePiece's own default


class TrainError(ValueError):
    """Settings that cannot train a tokenizer; the message names the flag."""


class _Reading:
    """The documents of the inputs, line by line, with a progress bar and counts for the record."""

    def __init__(
        self,
        files: list[InputFile],
        doc_unit: str,
        jsonl_field: str,
        strict: bool,
        progress: bool,
        allow_empty: bool = False,
    ):
        self.files, self.doc_unit, self.jsonl_field, self.strict = files, doc_unit, jsonl_field, strict
        self.progress, self.allow_empty = progress, allow_empty
        self.statistics = {"documents": 0, "lines": 0, "empty_documents": 0, "replaced_bytes": 0, "bytes": 0}

    def line_batches(self) -> Iterator[list[str]]:
        """The non-blank lines of the non-empty documents, a chunk at a time."""
        plain = all(not f.name.endswith(".gz") for f in self.files)
        with tqdm(
            total=sum(f.size for f in self.files) if plain else None,
            unit="B",
            unit_scale=True,
            desc="reading",
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
        ) as bar:
            for chunk in corpus.read_chunks(self.files, self.doc_unit, corpus.DEFAULT_CHUNK_BYTES):
                text = corpus.chunk_documents(chunk, self.doc_unit, self.jsonl_field, self.strict)
                lines = [line for document in text.documents for line in document if line.strip()]
                statistics = self.statistics
                statistics["documents"] += len(text.documents)
                statistics["lines"] += len(lines)
                statistics["empty_documents"] += text.empty
                statistics["replaced_bytes"] += text.replaced_bytes
                statistics["bytes"] += len(chunk.data)
                bar.update(len(chunk.data))
                yield lines
        self._check_not_empty()

    def record(self) -> dict[str, Any]:
        return {"inputs": [f.describe() for f in self.files], "doc_per": self.doc_unit, "statistics": self.statistics}

    def count_words(self, workers: int) -> collections.Counter:
        """How often each whitespace-separated word occurs in the non-empty documents, counted by ``workers``
        processes (each counts the chunks it is given and hands over its totals once, at the end)."""
        if workers < 1:
            raise TrainError(f"--workers {workers}: must be at least 1")
        plain = all(not f.name.endswith(".gz") for f in self.files)
        settings = _CountSettings(self.doc_unit, self.jsonl_field, self.strict)
        chunks = corpus.read_chunks(self.files, self.doc_unit, corpus.DEFAULT_CHUNK_BYTES)
        if workers > 1:
            chunks = map(corpus.portable, chunks)
        totals: list[_WordCounts] = []
        results = ordered_map(_count_chunk, chunks, workers, _start_counting, (settings,), finalizer=_counted)
        try:
            with tqdm(
                total=sum(f.size for f in self.files) if plain else None,
                unit="B",
                unit_scale=True,
                desc="counting",
                file=sys.stderr,
                disable=not self.progress,
                dynamic_ncols=True,
            ) as bar:
                for result in results:
                    if isinstance(result, _WordCounts):
                        totals.append(result)
                        continue
                    for key, value in result.items():
                        self.statistics[key] += value
                    bar.update(result["bytes"])
        except WorkerError as error:
            raise TrainError(f"counting stopped: {error}") from error
        finally:
            results.close()
        self._check_not_empty()
        return _WordCounts.combine(totals)

    def _check_not_empty(self) -> None:
        if self.statistics["documents"] == 0 and not self.allow_empty:
            # Raised from the end of the reading, before the tokenizer's files are written.
            names = ", ".join(str(f.name) for f in self.files[:3]) + (", ..." if len(self.files) > 3 else "")
            raise TrainError(
                f"no document in the input {names} ({len(self.files)} files, "
                f"{self.statistics['bytes']:,} bytes, {self.statistics['empty_documents']:,} blank "
                f"documents): check --input, or pass --allow-empty for a tokenizer of the special "
                f"symbols only"
            )


# ---- word counting in worker processes (spawned: they import this module, so keep its imports light) --------


@dataclasses.dataclass(frozen=True)
class _CountSettings:
    doc_unit: str
    jsonl_field: str
    strict: bool


class _WordCounts:
    """The words one process counted: short words as packed keys (`txl_dist.word_scan`) with their counts,
    merged into one sorted array whenever enough have piled up; longer words (bytes) and the words of chunks
    that took the ``str`` path in Counters."""

    MERGE_EVERY = 1 << 22  # keys piled up before a merge: ~64 MB of arrays at most

    def __init__(self) -> None:
        self.keys: list[np.ndarray] = []
        self.key_counts: list[np.ndarray] = []
        self.piled = 0
        self.long: collections.Counter = collections.Counter()
        self.text: collections.Counter = collections.Counter()

    def add_keys(self, keys: np.ndarray, counts: np.ndarray) -> None:
        self.keys.append(keys)
        self.key_counts.append(counts)
        self.piled += len(keys)
        if self.piled > self.MERGE_EVERY:
            self._merge()

    def _merge(self) -> None:
        keys, counts = word_scan.merge_counts(self.keys, self.key_counts)
        self.keys, self.key_counts, self.piled = [keys], [counts], 0

    def __getstate__(self) -> dict[str, Any]:
        self._merge()
        return self.__dict__

    @staticmethod
    def combine(parts: list[_WordCounts]) -> collections.Counter:
        """The counts of several processes as one Counter of words (str)."""
        keys, counts = word_scan.merge_counts(
            [k for part in parts for k in part.keys], [c for part in parts for c in part.key_counts]
        )
        # Short and long words come from chunks that are valid UTF-8 split at ASCII whitespace: each is valid
        # UTF-8 on its own, and decodes to the str that str.split() gives.
        total = collections.Counter(
            dict(zip((word.decode("utf-8") for word in word_scan.unpack_keys(keys)), counts.tolist()))
        )
        for part in parts:
            for word, count in part.long.items():
                total[word.decode("utf-8")] += count
            total.update(part.text)
        return total


_counts: tuple[_CountSettings, _WordCounts] | None = None


def _start_counting(settings: _CountSettings) -> None:
    global _counts
    _counts = (settings, _WordCounts())


def _count_chunk(chunk: corpus.Chunk) -> dict[str, int]:
    """Count a chunk's words into this process's totals; returns the chunk's statistics."""
    settings, counts = _counts
    chunk = corpus.resolve(chunk)
    scan = None
    if settings.doc_unit == "line" and not chunk.jsonl:
        scan = word_scan.scan_lines(chunk.data)
    if scan is None:
        text = corpus.chunk_documents(chunk, settings.doc_unit, settings.jsonl_field, settings.strict)
        lines = [line for document in text.documents for line in document if line.strip()]
        counts.text.update(" ".join(lines).split())
        return {
            "documents": len(text.documents),
            "lines": len(lines),
            "empty_documents": text.empty,
            "replaced_bytes": text.replaced_bytes,
            "bytes": len(chunk.data),
        }
    short = scan.short()
    counts.add_keys(*word_scan.count_keys(scan.packed_keys(short)))
    long_words = np.flatnonzero(~short)
    if len(long_words):
        counts.long.update(scan.words(long_words))
    documents = int(np.count_nonzero(scan.words_per_line))
    return {
        "documents": documents,
        "lines": documents,
        "empty_documents": len(scan.words_per_line) - documents,
        "replaced_bytes": 0,
        "bytes": len(chunk.data),
    }


def _counted() -> _WordCounts:
    return _counts[1]


def train_word(
    reading: _Reading,
    output: Path,
    min_count: int,
    max_size: int | None,
    specials: list[str],
    eos: str | None,
    eod: str | None,
    unk: str,
    workers: int = 1,
) -> Tokenizer:
    """Vocabulary: ``specials`` (and ``eod``; and ``unk`` unless it is a kept word), then the words seen at
    least ``min_count`` times by descending count (ties in code point order), at most ``max_size`` entries in
    all. The words are counted by ``workers`` processes; the vocabulary is the same for any number."""
    if min_count < 1:
        raise TrainError(f"--min-count {min_count}: must be at least 1")
    specials, eos = _word_specials(specials, eos, eod, unk)
    if max_size is not None and max_size <= len(specials) + 1:
        raise TrainError(f"--max-size {max_size}: leaves no room for words besides the specials {specials}")
    counts = reading.count_words(workers)
    words = sorted(
        (word for word, count in counts.items() if count >= min_count and word not in specials),
        key=lambda word: (-counts[word], word),
    )
    if max_size is not None:
        words = words[: max_size - len(specials)]
    if unk not in specials and unk not in set(words):
        # PTB's text holds <unk>, which then keeps its place among the words; otherwise it is a special.
        specials.append(unk)
        if max_size is not None and len(specials) + len(words) > max_size:
            words.pop()
    entries = specials + words
    write_word_vocab(output / WORD_VOCAB, entries, [counts.get(token, 0) for token in entries])
    ids = {token: i for i, token in enumerate(entries)}
    eod = eod or eos
    training = {
        "kind": "word",
        "min_count": min_count,
        "max_size": max_size,
        "specials": specials,
        "distinct_words": len(counts),
        **reading.record(),
    }
    return write_tokenizer_json(
        output,
        "word",
        [WORD_VOCAB],
        len(entries),
        ids[eos],
        ids[eod],
        ids[unk],
        {"eos": eos, "eod": eod, "unk": unk},
        training,
    )


def _word_specials(specials: list[str], eos: str | None, eod: str | None, unk: str) -> tuple[list[str], str]:
    """The special tokens of a word vocabulary, ``eod`` appended when it is not one, and the separator."""
    specials = list(dict.fromkeys(specials))
    if not specials:
        raise TrainError("--specials: give at least the end-of-sentence token, e.g. --specials '<eos>'")
    eos = eos or specials[0]
    for flag, token in (("--eos", eos), ("--eod", eod), ("--unk", unk)):
        if token is not None and (not token or any(c.isspace() for c in token)):
            raise TrainError(f"{flag} {token!r}: a token cannot be empty or contain whitespace")
    if eos not in specials:
        raise TrainError(f"--eos {eos!r} is not one of --specials {specials}")
    if eod is not None and eod not in specials:
        specials.append(eod)
    return specials, eos


def sample_lines(batches: Iterable[list[str]], size: int, seed: int) -> list[str]:
    """A uniform random sample of ``size`` lines (all of them if there are fewer), in one pass and memory for
    ``size`` lines: reservoir sampling (Algorithm R) with a seeded generator, so the same input and seed give
    the same sample. (SentencePiece's own sampler draws a new sample every run.)"""
    generator = np.random.default_rng(seed)
    reservoir: list[str] = []
    seen = 0
    for lines in batches:
        room = size - len(reservoir)
        if room > 0:
            reservoir.extend(lines[:room])
            seen += min(room, len(lines))
            lines = lines[room:]
        if lines:
            # Line number i (from 0) replaces a uniform slot of [0, i] when that slot is in the reservoir.
            slots = generator.integers(0, seen + np.arange(1, len(lines) + 1))
            for position in np.flatnonzero(slots < size):
                reservoir[slots[position]] = lines[position]
            seen += len(lines)
    return reservoir


# Where a long line may be cut for training: after a sentence's final punctuation and any closing quotes or
# brackets, where whitespace follows.
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f][\"'\u201d\u2019)\]]*(?=\s)")


def training_pieces(line: str, max_bytes: int) -> list[str]:
    """``line`` as pieces of at most ``max_bytes`` bytes of UTF-8 each, for SentencePiece, which silently drops
    every training sentence longer than its ``max_sentence_length``: whole sentences where the line holds
    sentence ends, a sentence still too long cut at whitespace into the longest runs of words that fit, and a
    single word longer than that cut between characters. Whitespace at the cuts is dropped; nothing else is."""
    if len(line) * 4 <= max_bytes or len(line.encode("utf-8")) <= max_bytes:
        return [line]
    pieces: list[str] = []
    cuts = [0] + [end.end() for end in _SENTENCE_END.finditer(line)] + [len(line)]
    for sentence in (line[start:stop].strip() for start, stop in zip(cuts[:-1], cuts[1:])):
        if not sentence:
            continue
        if len(sentence.encode("utf-8")) <= max_bytes:
            pieces.append(sentence)
            continue
        run, run_bytes = [], 0
        for word in sentence.split():
            size = len(word.encode("utf-8"))
            if run and run_bytes + 1 + size > max_bytes:
                pieces.append(" ".join(run))
                run, run_bytes = [], 0
            if size > max_bytes:
                pieces.extend(_cut_word(word, max_bytes))
                continue
            run_bytes += size + (1 if run else 0)
            run.append(word)
        if run:
            pieces.append(" ".join(run))
    return pieces


def _cut_word(word: str, max_bytes: int) -> list[str]:
    """A word longer than ``max_bytes`` bytes in pieces of at most that many, cut between characters."""
    pieces, start, size = [], 0, 0
    for index, character in enumerate(word):
        width = len(character.encode("utf-8"))
        if size + width > max_bytes:
            pieces.append(word[start:index])
            start, size = index, 0
        size += width
    pieces.append(word[start:])
    return pieces


def train_sentencepiece(
    reading: _Reading,
    output: Path,
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    input_sentence_size: int,
    user_symbols: list[str],
    eod_symbol: str | None,
    seed: int,
    threads: int,
    max_sentence_length: int = DEFAULT_MAX_SENTENCE_LENGTH,
) -> Tokenizer:
    """A SentencePiece model trained on ``input_sentence_size`` pieces sampled uniformly from the input's lines
    (see `sample_lines`: memory is bounded whatever the corpus size, and training is reproducible). A line
    longer than ``max_sentence_length`` bytes is first cut into pieces that are not (`training_pieces`), so
    that documents of one long line (a speech, an article) are trained on instead of being dropped."""
    import sentencepiece

    if input_sentence_size < 1:
        raise TrainError(f"--input-sentence-size {input_sentence_size}: must be positive")
    if max_sentence_length < 16:
        raise TrainError(f"--max-sentence-length {max_sentence_length}: must be at least 16 bytes")
    if eod_symbol is not None and eod_symbol not in user_symbols:
        user_symbols = user_symbols + [eod_symbol]
    sample, cut_lines = _training_sample(reading, max_sentence_length, input_sentence_size, seed)
    model = _train_model(sample, vocab_size, model_type, character_coverage, max_sentence_length, user_symbols, threads)
    atomic_write(output / SENTENCEPIECE_MODEL, lambda handle: handle.write(model))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(output / SENTENCEPIECE_MODEL))
    eos_id, unk_id = processor.eos_id(), processor.unk_id()
    eod_id = processor.piece_to_id(eod_symbol) if eod_symbol is not None else eos_id
    training = {
        "kind": "sentencepiece",
        "model_type": model_type,
        "character_coverage": character_coverage,
        "input_sentence_size": input_sentence_size,
        "sampled_lines": len(sample),
        "seed": seed,
        "threads": threads,
        "max_sentence_length": max_sentence_length,
        "lines_cut": cut_lines,
        "user_symbols": user_symbols,
        **reading.record(),
    }
    pieces = {
        "eos": processor.id_to_piece(eos_id),
        "eod": processor.id_to_piece(eod_id),
        "unk": processor.id_to_piece(unk_id),
    }
    return write_tokenizer_json(
        output,
        "sentencepiece",
        [SENTENCEPIECE_MODEL],
        processor.get_piece_size(),
        eos_id,
        eod_id,
        unk_id,
        pieces,
        training,
    )


def _training_sample(reading: _Reading, max_sentence_length: int, size: int, seed: int) -> tuple[list[str], int]:
    """``size`` training pieces sampled from the input's lines (`sample_lines`), and how many lines were cut into
    pieces (`training_pieces`)."""
    cut_lines = 0

    def piece_batches() -> Iterator[list[str]]:
        nonlocal cut_lines
        for lines in reading.line_batches():
            pieces = []
            for line in lines:
                line_pieces = training_pieces(line, max_sentence_length)
                cut_lines += len(line_pieces) > 1 or line_pieces[0] is not line
                pieces.extend(line_pieces)
            yield pieces

    sample = sample_lines(piece_batches(), size, seed)
    if not sample:
        files = ", ".join(f.name for f in reading.files[:3]) + (", ..." if len(reading.files) > 3 else "")
        raise TrainError(
            f"the input holds no text to train on ({reading.statistics['documents']:,} documents, "
            f"{reading.statistics['empty_documents']:,} of them blank, in {files})"
        )
    return sample, cut_lines


def _train_model(
    sample: list[str],
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    max_sentence_length: int,
    user_symbols: list[str],
    threads: int,
) -> bytes:
    """The bytes of a SentencePiece model trained on ``sample``."""
    import sentencepiece

    model = io.BytesIO()
    try:
        # model_writer rather than a model_prefix: the model records its trainer settings, and a path there
        # would make the same training give different bytes (and fingerprints) in different directories.
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=max_sentence_length,
            user_defined_symbols=user_symbols,
            num_threads=threads,
            minloglevel=1,
        )
    except RuntimeError as error:
        raise TrainError(f"sentencepiece could not train ({error})") from error
    return model.getvalue()


def _raw_chunks(reading: _Reading, what: str) -> Iterator[corpus.Chunk]:
    """The input's chunks as read, counted in ``reading.statistics`` (every line a document, none skipped)."""
    plain = all(not f.compressed for f in reading.files)
    with tqdm(
        total=sum(f.size for f in reading.files) if plain else None,
        unit="B",
        unit_scale=True,
        desc=what,
        file=sys.stderr,
        disable=not reading.progress,
        dynamic_ncols=True,
    ) as bar:
        for chunk in corpus.read_chunks(reading.files, "line", corpus.DEFAULT_CHUNK_BYTES):
            lines = chunk.data.count(b"\n") + (not chunk.data.endswith(b"\n"))
            reading.statistics["documents"] += lines
            reading.statistics["lines"] += lines
            reading.statistics["bytes"] += len(chunk.data)
            bar.update(len(chunk.data))
            yield chunk
    reading._check_not_empty()


def train_byte(reading: _Reading, output: Path) -> Tokenizer:
    """Every byte value one id (256, id = value), the newline byte the separator; the bytes of the input are
    counted for the record."""
    counts = np.zeros(256, dtype=np.int64)
    for chunk in _raw_chunks(reading, "counting bytes"):
        counts += np.bincount(np.frombuffer(chunk.data, dtype=np.uint8), minlength=256)
    write_word_vocab(output / BYTE_VOCAB, [byte_piece(value) for value in range(256)], counts.tolist())
    training = {"kind": "byte", "distinct_bytes": int(np.count_nonzero(counts)), **reading.record()}
    newline = byte_piece(NEWLINE)
    return write_tokenizer_json(
        output, "byte", [BYTE_VOCAB], 256, NEWLINE, NEWLINE, None, {"eos": newline, "eod": newline}, training
    )


def train_char(reading: _Reading, output: Path, alphabet: str | None) -> Tokenizer:
    """The newline (id 0, the separator), then every character of the training text (or of ``alphabet``, when
    given: a training character outside it is then an error naming it) by descending count, ties in code point
    order."""
    counts: collections.Counter = collections.Counter()
    for chunk in _raw_chunks(reading, "counting characters"):
        text, _ = corpus._decode(chunk, strict=True)
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        values, value_counts = np.unique(codes, return_counts=True)
        counts.update(dict(zip(map(chr, values.tolist()), value_counts.tolist())))
        if alphabet is not None:
            outside = sorted(set(counts) - set(alphabet) - {"\n"})
            if outside:
                raise TrainError(
                    f"{chunk.path}: character {outside[0]!r} (U+{ord(outside[0]):04X}) is not in "
                    f"--alphabet {alphabet!r}"
                )
    if alphabet is not None and len(set(alphabet)) != len(alphabet):
        raise TrainError(f"--alphabet {alphabet!r}: a character appears twice")
    characters = sorted(
        (set(alphabet) if alphabet is not None else set(counts)) - {"\n"},
        key=lambda character: (-counts.get(character, 0), character),
    )
    entries = ["\n"] + characters
    write_word_vocab(output / CHAR_VOCAB, [char_piece(c) for c in entries], [counts.get(c, 0) for c in entries])
    training = {"kind": "char", "alphabet": alphabet, "distinct_characters": len(counts), **reading.record()}
    return write_tokenizer_json(
        output, "char", [CHAR_VOCAB], len(entries), 0, 0, None, {"eos": "\n", "eod": "\n"}, training
    )


def _training_files(args: argparse.Namespace) -> list[InputFile]:
    if args.format == "text":
        if not args.input:
            raise TrainError("--input: give the training files (paths or glob patterns)")
        return corpus.input_files([str(p) for p in args.input])
    if args.doc_per not in (None, "line"):
        raise TrainError(f"--doc-per {args.doc_per}: --format {args.format} has one sentence per line")
    if len(args.input or []) > 1:
        raise TrainError(f"--format {args.format} takes one --input directory")
    directory = args.input[0] if args.input else None
    if args.format == "lm1b":
        if directory is None:
            raise TrainError("--format lm1b needs --input DIR (the r13output directory)")
        return corpus.lm1b_splits(directory)["train"]
    if args.format in ("enwik8", "text8", "wikitext"):
        if directory is None:
            raise TrainError(f"--format {args.format} needs --input (the file as downloaded, or its folder)")
        if args.format == "wikitext":
            return corpus.wikitext_splits(directory)["train"]
        splits = corpus.enwik8_splits if args.format == "enwik8" else corpus.text8_splits
        return splits(directory, args.held_out_bytes)["train"]
    return corpus.ptb_splits(directory)["train"]


def _prepare_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise TrainError(f"{output}: exists and is not a directory")
    output.mkdir(parents=True, exist_ok=True)
    entries = sorted(p.name for p in output.iterdir())
    if entries and not overwrite:
        raise TrainError(f"{output}: not empty ({', '.join(entries[:3])}); pass --overwrite to replace the tokenizer")
    for name in OWN_FILES:
        (output / name).unlink(missing_ok=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
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
    parser.add_argument("--format", choices=corpus.FORMATS, default="text")
    parser.add_argument("--doc-per", choices=corpus.DOC_UNITS, help="what a document is in text inputs (default: line)")
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
    return parser.parse_args(argv)


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
        default=corpus.HELD_OUT_BYTES,
        help="--format enwik8|text8: bytes of valid and of test at the end of the file, left out "
        "of training (the authors' 5,000,000; smaller for a scaled-down copy)",
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
    args = parse_args(argv)
    started = time.perf_counter()
    created = False
    try:
        if args.kind is None:
            raise TrainError("--kind: choose sentencepiece, word, byte or char (or a --preset)")
        if args.kind == "sentencepiece" and args.workers != 1:
            raise TrainError(
                f"--workers {args.workers}: only --kind word counts in processes; sentencepiece trains with --threads"
            )
        files = _training_files(args)
        try:  # before anything in the output is deleted
            refuse_output_over_inputs(
                args.output, [f.name for f in files if not f.name.startswith(corpus.TREEBANK_PREFIX)]
            )
        except OutputPathError as error:
            raise TrainError(str(error)) from None
        created = not args.output.exists()
        _prepare_output(args.output, args.overwrite)
        reading = _Reading(
            files, args.doc_per or "line", args.jsonl_field, args.strict, args.progress, args.allow_empty
        )
        tokenizer = _train(args, reading)
    except (TrainError, InputError, TokenizerError, OSError) as error:
        # A refused input leaves no trace: the folder this run created goes again while nothing is in it.
        if created and args.output.is_dir() and not any(args.output.iterdir()):
            try:
                args.output.rmdir()
            except OSError:  # another process put a file there meanwhile: not ours to remove
                pass
        # OSError: a read-only or full output, a file where the folder should be.
        message = describe_os_error(error) if isinstance(error, OSError) else str(error)
        print(f"train_tokenizer: error: {message}", file=sys.stderr)
        return 1
    statistics = reading.statistics
    print(
        f"train_tokenizer: {tokenizer.kind} tokenizer of {tokenizer.vocab_size:,} entries in {args.output} "
        f"(eos {tokenizer.eos_id}, eod {tokenizer.eod_id}, unk {tokenizer.unk_id}) from {statistics['documents']:,} "
        f"documents, {statistics['lines']:,} lines; {statistics['empty_documents']:,} empty documents skipped, "
        f"{statistics['replaced_bytes']:,} non-UTF-8 bytes replaced; {time.perf_counter() - started:.1f} s"
    )
    return 0


def _train(args: argparse.Namespace, reading: _Reading) -> Tokenizer:
    """The tokenizer of ``--kind``, trained on ``reading`` and written to ``--output``."""
    if args.kind == "byte":
        return train_byte(reading, args.output)
    if args.kind == "char":
        return train_char(reading, args.output, args.alphabet)
    if args.kind == "word":
        return train_word(
            reading,
            args.output,
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
        args.output,
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
    sys.exit(main())
