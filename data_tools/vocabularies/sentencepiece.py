"""Training a SentencePiece model on a sample of the input's lines, long lines cut into pieces it does not drop."""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import sentencepiece

from data_tools.errors import InputError
from data_tools.vocabularies.reading import Reading
from txl_dist.fileio import atomic_write
from txl_dist.tokenizer import SENTENCEPIECE_MODEL, Tokenizer, write_tokenizer_json

DEFAULT_MAX_SENTENCE_LENGTH = 4192  # bytes: SentencePiece's own default


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
    reading: Reading,
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
    if input_sentence_size < 1:
        raise InputError(f"--input-sentence-size {input_sentence_size}: must be positive")
    if max_sentence_length < 16:
        raise InputError(f"--max-sentence-length {max_sentence_length}: must be at least 16 bytes")
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


def _training_sample(reading: Reading, max_sentence_length: int, size: int, seed: int) -> tuple[list[str], int]:
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
        raise InputError(
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
    """The bytes of a SentencePiece model trained on ``sample``.

    SentencePiece trains in C++ for minutes on a large sample, and Python runs a Ctrl-C's handler only between
    its own instructions: in this thread the interrupt would wait for the training to end. The training runs in
    a daemon thread instead (it releases the GIL), and this one waits in short joins, where a Ctrl-C arrives at
    once; the abandoned training ends with the process."""
    model = io.BytesIO()
    failure: list[BaseException] = []

    def train() -> None:
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
        except BaseException as error:  # handed to the waiting thread, which raises it
            failure.append(error)

    trainer = threading.Thread(target=train, name="sentencepiece-training", daemon=True)
    trainer.start()
    while trainer.is_alive():
        trainer.join(0.05)
    if failure:
        if isinstance(failure[0], RuntimeError):
            raise InputError(f"sentencepiece could not train ({failure[0]})") from failure[0]
        raise failure[0]
    return model.getvalue()
