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
    """Every byte one id (its value); the newline byte ends lines and documents (see the module docstring). Its
    rules (`txl_dist.tokenizer.rules`) may list the ids in another order, and drop line breaks."""

    kind = "byte"
    character_level = True

    def _load(self) -> int:
        path = self.directory / self.files[0]
        pieces, self.counts = read_word_vocab(path)
        if self.rules.ids == "listed":
            values = self._listed_values(path, pieces)
        else:
            values = list(range(256))
            expected = [byte_piece(value) for value in values]
            if pieces != expected:
                first = next((i for i, (a, b) in enumerate(zip(pieces, expected)) if a != b), min(len(pieces), 256))
                raise TokenizerError(
                    f"{path}: line {first + 1} should be {expected[first]!r} "
                    f"(256 lines <0x00> .. <0xFF>, one per byte value)"
                    if first < 256
                    else f"{path}: {len(pieces)} lines, expected 256 (<0x00> .. <0xFF>)"
                )
        self._values = np.asarray(values, dtype=np.uint8)
        """Per id: its byte."""
        self._ids = np.full(256, -1, dtype=np.int32)
        """Per byte value: its id, -1 for a byte the vocabulary does not list."""
        self._ids[self._values] = np.arange(len(values), dtype=np.int32)
        self._identity = values == list(range(256))
        _check_separators(self, self._ids[NEWLINE] if self._ids[NEWLINE] >= 0 else None, "the newline byte <0x0A>")
        return len(pieces)

    @staticmethod
    def _listed_values(path, pieces: list[str]) -> list[int]:
        """The byte of each line of a listed ``bytes.txt`` (each ``<0xHH>``, each byte once)."""
        values = []
        for number, piece in enumerate(pieces, start=1):
            if not re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
                raise TokenizerError(f"{path}, line {number}: expected a byte <0xHH>, got {piece!r}")
            values.append(int(piece[3:5], 16))
        return values

    def encode(self, text: str) -> list[int]:
        return self.encode_bytes(text.encode("utf-8", "surrogateescape")).tolist()

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """The ids of raw bytes (uint8 for the 256 byte values; one per byte, the newline included unless the
        rules drop line breaks)."""
        ids = np.frombuffer(data, dtype=np.uint8)
        if self.rules.drops_line_breaks:
            ids = ids[ids != NEWLINE]
        if self._identity:
            return ids
        mapped = self._ids[ids]
        if len(mapped) and mapped.min() < 0:
            value = int(ids[np.flatnonzero(mapped < 0)[0]])
            raise ValueError(
                f"byte {byte_piece(value)} is not in the vocabulary of {self.directory / self.files[0]} "
                f"(it lists {len(self._values)} byte values)"
            )
        return mapped

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            self._check_id(int(ids[(ids < 0) | (ids >= self.vocab_size)][0]))
        return self._values[ids].tobytes()

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", "surrogateescape")

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.rules.drops_line_breaks:
            return _run_together(self, documents, lambda text: self.encode_bytes(_utf8(text)), dtype)
        # Each line's bytes and its newline: the documents' lines joined, each ended, are exactly the stream.
        data = "".join(line + "\n" for document in documents for line in document).encode("utf-8", "surrogateescape")
        tokens = self.encode_bytes(data).astype(dtype)
        lengths = [sum(len(line.encode("utf-8", "surrogateescape")) + 1 for line in document) for document in documents]
        return tokens, np.array(lengths, dtype=np.int64)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(int(token_id))
        return byte_piece(int(self._values[int(token_id)]))


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
        if not self.rules.drops_line_breaks and (
            not characters or characters[0] != "\n" or (self.eos_id, self.eod_id, self.unk_id) != (0, 0, None)
        ):
            raise TokenizerError(
                f"{path}: a character tokenizer has the newline U+000A as id 0 (eos_id = eod_id = 0, unk_id null)"
            )
        if len(set(characters)) != len(characters):
            raise TokenizerError(f"{path}: a character is listed twice")
        _check_separators(self, characters.index("\n") if "\n" in characters else None, "the newline U+000A")
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
        """`encode` as an int32 array, computed with numpy (line breaks left out where the rules drop them; an
        unknown character's index is still its index in ``text``)."""
        codes = _code_points(text)
        if not self.rules.drops_line_breaks:
            return self.encode_codes(codes, where)
        kept = np.flatnonzero(codes != ord("\n"))
        try:
            return self.encode_codes(codes[kept], where)
        except UnknownCharacterError as error:
            index = int(kept[error.index])
            message = str(error).replace(f"character {error.index})", f"character {index})")
            raise UnknownCharacterError(message, error.character, index) from None

    def encode(self, text: str) -> list[int]:
        return self.encode_text(text).tolist()

    def encode_documents(
        self, documents: Sequence[Sequence[str]], dtype: np.dtype | type = np.int64
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.rules.drops_line_breaks:
            return _run_together(self, documents, self.encode_text, dtype)
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


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _check_separators(tokenizer: Tokenizer, newline_id: int | None, newline: str) -> None:
    """The special ids of a byte or char tokenizer against its rules: no unknown token; ``eos_id = eod_id``, the
    newline's id where line breaks separate lines, and any id of the vocabulary where they are dropped."""
    path = tokenizer.directory / TOKENIZER_JSON
    if tokenizer.unk_id is not None or tokenizer.eos_id != tokenizer.eod_id:
        raise TokenizerError(
            f"{path}: a {tokenizer.kind} tokenizer has eos_id = eod_id and unk_id null, got "
            f"{tokenizer.eos_id}, {tokenizer.eod_id}, {tokenizer.unk_id}"
        )
    if tokenizer.rules.drops_line_breaks:
        if not 0 <= tokenizer.eod_id < tokenizer.vocab_size:
            raise TokenizerError(f"{path}: eod_id {tokenizer.eod_id} is outside [0, {tokenizer.vocab_size})")
    elif tokenizer.eod_id != newline_id:
        raise TokenizerError(
            f"{path}: a {tokenizer.kind} tokenizer whose line breaks separate lines has eos_id = eod_id = the id "
            f"of {newline} ({newline_id}), got {tokenizer.eod_id}"
        )


def _run_together(
    tokenizer: Tokenizer, documents: Sequence[Sequence[str]], encode, dtype: np.dtype | type
) -> tuple[np.ndarray, np.ndarray]:
    """`Tokenizer.encode_documents` where line breaks are dropped: each document's lines run together, and the
    document ends with ``eod_id``."""
    pieces = []
    for document in documents:
        pieces.append(np.asarray(encode("".join(document)), dtype=dtype))
        pieces.append(np.asarray([tokenizer.eod_id], dtype=dtype))
    lengths = np.array([len(piece) for piece in pieces[0::2]], dtype=np.int64) + 1
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return tokens, lengths
