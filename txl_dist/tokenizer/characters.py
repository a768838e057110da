"""Tokenizers whose every token is one character: bytes (enwik8) and the characters of an alphabet (text8)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from txl_dist.tokenizer.base import TOKENIZER_JSON, Tokenizer, TokenizerError
from txl_dist.tokenizer.vocab_files import byte_piece, read_word_vocab

NEWLINE = 10
"""The byte tokenizer's ``eos_id`` and ``eod_id``: the newline byte."""


class UnknownCharacterError(ValueError):
    """A character outside a char tokenizer's alphabet: ``character``, at ``index`` (in characters) of the text
    encoded, so that a caller that knows where the text came from can name the file and the byte offset."""

    def __init__(self, message: str, character: str, index: int):
        super().__init__(message)
        self.character = character
        self.index = index


class ByteTokenizer(Tokenizer):
    """Every byte one id (its value); the newline byte ends lines and documents (see the module docstring)."""

    kind = "byte"
    character_level = True

    def _load(self) -> int:
        path = self.directory / self.files[0]
        pieces, self.counts = read_word_vocab(path)
        expected = [byte_piece(value) for value in range(256)]
        if pieces != expected:
            first = next((i for i, (a, b) in enumerate(zip(pieces, expected)) if a != b), min(len(pieces), 256))
            raise TokenizerError(
                f"{path}: line {first + 1} should be {expected[first]!r} "
                f"(256 lines <0x00> .. <0xFF>, one per byte value)"
                if first < 256
                else f"{path}: {len(pieces)} lines, expected 256 (<0x00> .. <0xFF>)"
            )
        if (self.eos_id, self.eod_id, self.unk_id) != (NEWLINE, NEWLINE, None):
            raise TokenizerError(
                f"{self.directory / TOKENIZER_JSON}: a byte tokenizer has eos_id = eod_id = 10 (the "
                f"newline byte) and unk_id null, got {self.eos_id}, {self.eod_id}, {self.unk_id}"
            )
        return len(pieces)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogateescape"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """The ids of raw bytes (uint8; one per byte, the newline included)."""
        return np.frombuffer(data, dtype=np.uint8)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() > 255):
            self._check_id(int(ids[(ids < 0) | (ids > 255)][0]))
        return ids.astype(np.uint8).tobytes()

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", "surrogateescape")

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        # Each line's bytes and its newline: the documents' lines joined, each ended, are exactly the stream.
        data = "".join(line + "\n" for document in documents for line in document).encode("utf-8", "surrogateescape")
        tokens = np.frombuffer(data, dtype=np.uint8).astype(dtype)
        lengths = [sum(len(line.encode("utf-8", "surrogateescape")) + 1 for line in document) for document in documents]
        return tokens, np.array(lengths, dtype=np.int64)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return byte_piece(int(token_id))


class CharTokenizer(Tokenizer):
    """Every character of an alphabet one id; id 0 is the newline, which ends lines and documents."""

    kind = "char"
    character_level = True

    def _load(self) -> int:
        path = self.directory / self.files[0]
        pieces, self.counts = read_word_vocab(path)
        characters = []
        for number, piece in enumerate(pieces, start=1):
            if not re.fullmatch(r"U\+[0-9A-F]{4,6}", piece) or int(piece[2:], 16) > 0x10FFFF:
                raise TokenizerError(f"{path}, line {number}: expected a code point U+XXXX, got {piece!r}")
            characters.append(chr(int(piece[2:], 16)))
        if not characters or characters[0] != "\n" or (self.eos_id, self.eod_id, self.unk_id) != (0, 0, None):
            raise TokenizerError(
                f"{path}: a character tokenizer has the newline U+000A as id 0 (eos_id = eod_id = 0, unk_id null)"
            )
        self.characters = characters
        self.is_space = np.array([c.isspace() for c in characters])
        """Per id: whitespace for ``str.split()``."""
        # Code point -> id (-1: not in the alphabet), one int32 per code point up to the largest of the alphabet.
        self._ids = np.full(max(map(ord, characters)) + 1, -1, dtype=np.int32)
        self._ids[[ord(c) for c in characters]] = np.arange(len(characters), dtype=np.int32)
        return len(characters)

    def encode_codes(self, codes: np.ndarray, where: str = "the text") -> np.ndarray:
        """Ids (int32) of code points; a character outside the alphabet is an `UnknownCharacterError` naming it."""
        inside = codes < len(self._ids)
        ids = self._ids[np.where(inside, codes, 0)] if not inside.all() else self._ids[codes]
        unknown = (ids < 0) | ~inside
        if unknown.any():
            first = int(np.flatnonzero(unknown)[0])
            character = chr(int(codes[first]))
            raise UnknownCharacterError(
                f"{where}: character {character!r} (U+{int(codes[first]):04X}, "
                f"character {first}) is not in the alphabet of {self.directory / self.files[0]}",
                character,
                first,
            )
        return ids

    def encode_text(self, text: str, where: str = "the text") -> np.ndarray:
        """`encode` as an int32 array, computed with numpy."""
        return self.encode_codes(_code_points(text), where)

    def encode(self, text: str) -> list[int]:
        return self.encode_text(text).tolist()

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        text = "".join(line + "\n" for document in documents for line in document)
        lengths = [sum(len(line) + 1 for line in document) for document in documents]
        return self.encode_text(text).astype(dtype), np.array(lengths, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.id_to_piece(token_id) for token_id in ids)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return self.characters[int(token_id)]


def _code_points(text: str) -> np.ndarray:
    """The code points of ``text``: uint8 for ASCII text (a quarter of the memory), else uint32."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
