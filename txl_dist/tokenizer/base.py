"""The interface every kind of tokenizer implements: encode, decode, documents, special ids (with the names of a
tokenizer directory's files)."""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_JSON = "tokenizer.json"
KINDS = ("sentencepiece", "word", "byte", "char")
CHARACTER_KINDS = ("byte", "char")
"""Kinds whose every token is one character (a byte for ``byte``): their loss per token is bits per character."""
SENTENCEPIECE_MODEL = "spm.model"
WORD_VOCAB = "vocab.txt"
BYTE_VOCAB = "bytes.txt"
CHAR_VOCAB = "chars.txt"


class TokenizerError(ValueError):
    """A tokenizer directory that is missing, damaged or inconsistent; the message names the file."""


@dataclasses.dataclass(frozen=True)
class ReadingRules:
    """The settings of a ``rules.json`` (each its kind's default when absent)."""

    lower_case: bool = False
    line_start: str | None = None
    line_breaks: str = "separator"
    ids: str = "byte_values"

    def to_json(self) -> dict[str, Any]:
        """The settings that differ from the defaults (what ``rules.json`` holds)."""
        defaults = ReadingRules()
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(defaults, field.name)
        }

    @property
    def drops_line_breaks(self) -> bool:
        return self.line_breaks == "dropped"


DEFAULT_RULES = ReadingRules()


class Tokenizer(abc.ABC):
    """What the rest of the system sees of a tokenizer. Create one with `load_tokenizer`."""

    kind: str
    character_level: bool = False
    """Every token is one character (or byte): the loss per token in bits is the bits per character."""

    def __init__(
        self,
        directory: Path,
        files: list[str],
        fingerprint: str,
        vocab_size: int,
        eos_id: int,
        eod_id: int,
        unk_id: int | None,
        rules: ReadingRules = DEFAULT_RULES,
    ):
        self.directory = directory
        self.files = files
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.eod_id = eod_id
        self.unk_id = unk_id
        self.rules = rules
        """How text is read where it departs from the kind's defaults (`txl_dist.tokenizer.rules`)."""
        self._entries = self._load()

    @abc.abstractmethod
    def _load(self) -> int:
        """Read and check the tokenizer's file; returns its number of vocabulary entries (`load_tokenizer` checks
        it against ``vocab_size``)."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of one line (or any text); no separator is appended."""

    def encode_batch(self, lines: Sequence[str]) -> list[list[int]]:
        """`encode` of each line; subclasses make it faster than a loop."""
        return [self.encode(line) for line in lines]

    def line_prefix(self) -> list[int]:
        """Ids put before every line (a word tokenizer's ``line_start`` rule); none by default."""
        return []

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids (the inverse of `encode` up to normalisation)."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id."""

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        """Token stream of documents given as lists of lines (see the module docstring).

        Returns ``(tokens, tokens_per_document)``: the documents' tokens one after another, separators included,
        as one array of ``dtype``, and how many of them belong to each document.
        """
        lines_per_document = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        if len(documents) and lines_per_document.min() == 0:
            raise ValueError("a document needs at least one line")
        encoded = self.encode_batch([line for document in documents for line in document])
        prefix = self.line_prefix()
        if prefix:
            encoded = [prefix + line_ids for line_ids in encoded]
        if len(encoded) == len(documents):  # one line each (PTB, One Billion Word): the fast path
            for line_ids in encoded:
                line_ids.append(self.eod_id)
        else:
            last_lines = np.cumsum(lines_per_document) - 1
            for line_ids in encoded:
                line_ids.append(self.eos_id)
            for last_line in last_lines.tolist():
                encoded[last_line][-1] = self.eod_id
        tokens = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=sum(map(len, encoded)))
        line_tokens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        if len(encoded) == len(documents):
            return tokens, line_tokens
        return tokens, np.add.reduceat(line_tokens, np.cumsum(lines_per_document) - lines_per_document)

    def encode_document(self, text: str) -> list[int]:
        """Ids of a document given as text: its lines are the pieces between ``\\n`` characters."""
        return self.encode_documents([text.split("\n")])[0].tolist()

    def decode_document(self, ids: Sequence[int]) -> str:
        """Text of a document's ids: lines end at ``eos_id``/``eod_id`` and are joined with ``\\n`` (where the
        rules drop line breaks, the separator is a character of the text, decoded as it is)."""
        if self.rules.drops_line_breaks:
            return self.decode(list(ids))
        lines, line = [], []
        for token_id in ids:
            if token_id in (self.eos_id, self.eod_id):
                lines.append(self.decode(line))
                line = []
            else:
                line.append(token_id)
        if line:
            lines.append(self.decode(line))
        return "\n".join(lines)

    def identity(self) -> dict[str, Any]:
        """The fields of `txl_dist.data.format.TokenizerIdentity`."""
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
            "eos_id": self.eos_id,
            "eod_id": self.eod_id,
            "unk_id": self.unk_id,
        }

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.directory)!r}, vocab_size={self.vocab_size}, "
            f"eos_id={self.eos_id}, eod_id={self.eod_id}, unk_id={self.unk_id})"
        )
