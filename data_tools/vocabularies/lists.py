"""Building the vocabularies that need no model: words by count, every byte value, the characters of the text."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from data_tools.corpora import character_documents, chunking, text_decoding
from data_tools.errors import InputError
from data_tools.vocabularies.reading import Reading
from txl_dist.tokenizer import (
    BYTE_VOCAB,
    CHAR_VOCAB,
    NEWLINE,
    WORD_VOCAB,
    Tokenizer,
    byte_piece,
    char_piece,
    write_tokenizer_json,
    write_word_vocab,
)


def train_word(
    reading: Reading,
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
        raise InputError(f"--min-count {min_count}: must be at least 1")
    specials, eos = _word_specials(specials, eos, eod, unk)
    if max_size is not None and max_size <= len(specials) + 1:
        raise InputError(f"--max-size {max_size}: leaves no room for words besides the specials {specials}")
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
        raise InputError("--specials: give at least the end-of-sentence token, e.g. --specials '<eos>'")
    eos = eos or specials[0]
    for flag, token in (("--eos", eos), ("--eod", eod), ("--unk", unk)):
        if token is not None and (not token or any(c.isspace() for c in token)):
            raise InputError(f"{flag} {token!r}: a token cannot be empty or contain whitespace")
    if eos not in specials:
        raise InputError(f"--eos {eos!r} is not one of --specials {specials}")
    if eod is not None and eod not in specials:
        specials.append(eod)
    return specials, eos


def train_byte(reading: Reading, output: Path) -> Tokenizer:
    """Every byte value one id (256, id = value), the newline byte the separator; the bytes of the input are
    counted for the record."""
    counts = np.zeros(256, dtype=np.int64)
    for _, data in reading.character_texts("counting bytes", "byte"):
        counts += np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    write_word_vocab(output / BYTE_VOCAB, [byte_piece(value) for value in range(256)], counts.tolist())
    training = {"kind": "byte", "distinct_bytes": int(np.count_nonzero(counts)), **reading.record()}
    newline = byte_piece(NEWLINE)
    return write_tokenizer_json(
        output, "byte", [BYTE_VOCAB], 256, NEWLINE, NEWLINE, None, {"eos": newline, "eod": newline}, training
    )


def train_char(reading: Reading, output: Path, alphabet: str | None) -> Tokenizer:
    """The newline (id 0, the separator), then every character of the training text (or of ``alphabet``, when
    given: a training character outside it is then an error naming it) by descending count, ties in code point
    order."""
    counts: collections.Counter = collections.Counter()
    if alphabet is not None and len(set(alphabet)) != len(alphabet):
        raise InputError(f"--alphabet {alphabet!r}: a character appears twice")
    for chunk, text in reading.character_texts("counting characters", "char"):
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        values, value_counts = np.unique(codes, return_counts=True)
        counts.update(dict(zip(map(chr, values.tolist()), value_counts.tolist())))
        if alphabet is not None:
            outside = set(counts) - set(alphabet) - {"\n"}
            if outside:
                raise _outside_the_alphabet(chunk, text, outside, alphabet, reading.jsonl_field)
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


def _outside_the_alphabet(chunk: chunking.Chunk, text: str, outside: set[str], alphabet: str, field: str) -> InputError:
    """The error for the first character of ``text`` (what the chunk holds for a char tokenizer) that is not in
    ``alphabet``, naming where it is: the byte offset and line, or the line of the .jsonl record."""
    advice = "add it to --alphabet, or leave --alphabet out to learn the text's characters"
    if chunk.jsonl:
        raw = character_documents.decode(chunk, "char")
        for number, value in text_decoding.jsonl_records(raw, chunk, field):
            found = [c for c in value if c in outside]
            if found:
                return InputError(
                    f"{chunk.path}, line {number}: character {found[0]!r} (U+{ord(found[0]):04X}) of the record's "
                    f"text is not in --alphabet {alphabet!r}; {advice}"
                )
    index = min(text.find(character) for character in outside if character in text)
    offset = chunk.start.offset + len(text[:index].encode("utf-8", "surrogatepass"))
    line = chunk.start.line + text.count("\n", 0, index)
    return InputError(
        f"{chunk.path}: character {text[index]!r} (U+{ord(text[index]):04X}) at byte offset {offset} (line {line}) "
        f"is not in --alphabet {alphabet!r}; {advice}"
    )
