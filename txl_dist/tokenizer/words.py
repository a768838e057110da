"""Tokenizers of words and word pieces: whitespace-separated words looked up in a vocabulary, and SentencePiece."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import sentencepiece

from txl_dist.tokenizer.base import Tokenizer, TokenizerError
from txl_dist.tokenizer.rules import DEFAULT_RULES, RULES_FILE
from txl_dist.tokenizer.vocab_files import read_word_vocab
from txl_dist.word_scan import PackedVocabulary

if TYPE_CHECKING:
    from txl_dist.word_scan import LineWords


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (``spm.model``)."""

    kind = "sentencepiece"

    def _load(self) -> int:
        path = self.directory / self.files[0]
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:
            raise TokenizerError(f"{path}: not a valid SentencePiece model ({error})") from error
        return self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        # One thread: build_shards parallelises over processes; more threads here would oversubscribe the cores.
        return self._processor.encode(list(lines), num_threads=1)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        for token_id in ids:
            self._check_id(token_id)
        return self._processor.decode(ids)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return self._processor.id_to_piece(int(token_id))


class WordTokenizer(Tokenizer):
    """Whitespace-separated words looked up in ``vocab.txt``."""

    kind = "word"

    def _load(self) -> int:
        path = self.directory / self.files[0]
        self.words, self.counts = read_word_vocab(path)
        self._line_start: list[int] = []
        if self.rules.line_start is not None:
            if self.rules.line_start not in self.words:
                raise TokenizerError(
                    f"{self.directory / RULES_FILE}: 'line_start' {self.rules.line_start!r} is not in {path}"
                )
            self._line_start = [self.words.index(self.rules.line_start)]
        return len(self.words)

    def line_prefix(self) -> list[int]:
        return list(self._line_start)

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        # Built on first use: a process that only needs the ids of the specials (the shard builder's parent)
        # skips a dict of a million words.
        return {word: token_id for token_id, word in enumerate(self.words)}

    @functools.cached_property
    def _packed(self) -> PackedVocabulary:
        return PackedVocabulary(self.words, missing=-1 if self.unk_id is None else self.unk_id)

    def encode(self, text: str) -> list[int]:
        if self.rules.lower_case:
            text = text.lower()
        lookup, unk_id = self._ids.get, self.unk_id
        ids = [lookup(word, unk_id) for word in text.split()]
        if unk_id is None and None in ids:
            self._raise_unknown(next(word for word in text.split() if word not in self._ids))
        return ids

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        if self.unk_id is None or self.rules.lower_case:
            return [self.encode(line) for line in lines]
        lookup, unk_id = self._ids.get, self.unk_id
        return [[lookup(word, unk_id) for word in line.split()] for line in lines]

    def encode_scanned_lines(self, scan: LineWords, dtype: np.dtype | type = np.int64) -> tuple[np.ndarray, np.ndarray]:
        """The token stream of the lines of a chunk scanned by `txl_dist.word_scan.scan_lines`, each non-empty
        line a document of one line: exactly ``encode_documents([[line] for line in lines if line.split()])``,
        faster: the words are looked up as arrays (`txl_dist.word_scan.PackedVocabulary`), not one Python string
        at a time. Returns ``(tokens, tokens_per_document)``. Only for a tokenizer without rules (`fast_lines`)."""
        if not self.fast_lines:
            raise ValueError(f"{self.directory}: a tokenizer with rules {self.rules.to_json()} reads lines one by one")
        ids = self._packed.lookup(scan)
        if self.unk_id is None and len(ids) and ids.min() < 0:
            self._raise_unknown(scan.words(np.flatnonzero(ids < 0)[:1])[0].decode("utf-8"))
        words = scan.words_per_line[scan.words_per_line > 0]
        tokens_per_document = words + 1
        ends = np.cumsum(tokens_per_document) - 1  # where each document's eod_id goes
        tokens = np.empty(len(ids) + len(words), dtype=dtype)
        is_word = np.ones(len(tokens), dtype=bool)
        is_word[ends] = False
        tokens[is_word] = ids
        tokens[ends] = self.eod_id
        return tokens, tokens_per_document

    @property
    def fast_lines(self) -> bool:
        """`encode_scanned_lines` reads this tokenizer's lines (it has no rules)."""
        return self.rules == DEFAULT_RULES

    def _raise_unknown(self, word: str) -> None:
        raise ValueError(f"word {word!r} is not in {self.directory / self.files[0]} and it has no unk token")

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.id_to_piece(token_id) for token_id in ids)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return self.words[int(token_id)]
