"""The vocabulary files of a tokenizer directory: ``token<TAB>count`` lines, and how bytes and characters are
written in them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from txl_dist.fileio import atomic_write_text
from txl_dist.tokenizer.base import TokenizerError


def read_word_vocab(path: Path) -> tuple[list[str], list[int]]:
    """Words and counts of a ``vocab.txt`` (``token<TAB>count`` per line, the line number is the id)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TokenizerError(f"{path}: not UTF-8 text ({error})") from error
    except OSError as error:
        raise TokenizerError(f"{path}: cannot read word vocabulary ({error.strerror})") from error
    # Split on "\n" only: str.splitlines would also break at characters such as U+2028 (none can be inside a
    # word, but a damaged file should fail on its line number, not shift every id).
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    # The whole file at once, in C rather than a Python loop per line (vocabularies reach a million lines): split
    # on whitespace, the fields alternate word and count exactly when joining them back with tabs and newlines
    # gives the text.
    fields = text.split()
    words, counts = fields[0::2], fields[1::2]
    if words and len(fields) == 2 * len(lines):
        rebuilt = "\n".join(map("\t".join, zip(words, counts)))
        if text in (rebuilt, rebuilt + "\n") and all(map(str.isdecimal, counts)) and len(set(words)) == len(words):
            return words, list(map(int, counts))
    return _read_word_vocab_lines(path, lines)


def _read_word_vocab_lines(path: Path, lines: list[str]) -> tuple[list[str], list[int]]:
    """`read_word_vocab` line by line, for the error that names the first bad line."""
    words, counts, seen = [], [], set()
    for number, line in enumerate(lines, start=1):
        word, tab, count = line.partition("\t")
        if not tab or not word or not count.isdecimal() or any(c.isspace() for c in word):
            raise TokenizerError(f"{path}, line {number}: expected 'token<TAB>count', got {line[:80]!r}")
        if word in seen:
            raise TokenizerError(f"{path}, line {number}: token {word!r} appears twice")
        seen.add(word)
        words.append(word)
        counts.append(int(count))
    if not words:
        raise TokenizerError(f"{path}: empty word vocabulary")
    return words, counts


def write_word_vocab(path: Path, words: Sequence[str], counts: Sequence[int]) -> None:
    atomic_write_text(path, "".join(f"{word}\t{count}\n" for word, count in zip(words, counts)))


def byte_piece(value: int) -> str:
    """The vocabulary entry of a byte, as SentencePiece writes byte pieces: ``<0x0A>``."""
    return f"<0x{value:02X}>"


def char_piece(character: str) -> str:
    """The vocabulary entry of a character: its code point, ``U+0061`` (whitespace has no other written form)."""
    return f"U+{ord(character):04X}"
