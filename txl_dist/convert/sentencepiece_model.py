"""A SentencePiece model file read without protobuf: the pieces, their scores and types, and the normaliser settings.

The file is a ModelProto (field numbers of sentencepiece_model.proto), read with the small wire-format reader
below, so that converting a tokenizer needs neither `sentencepiece` nor `protobuf`.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
"""The piece types of ModelProto.SentencePiece.Type."""
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message: ints for varints and fixed32 as raw bytes, bytes for
    length-delimited fields."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated field")
        out.append((number, wire, value))
    return out


def _piece(message: bytes) -> dict[str, Any]:
    piece = {"piece": "", "score": 0.0, "type": NORMAL}
    for field, wire, item in _fields(message):
        if field == 1:
            piece["piece"] = item.decode("utf-8")
        elif field == 2 and wire == 5:
            piece["score"] = struct.unpack("<f", item)[0]
        elif field == 3:
            piece["type"] = item
    return piece


def read_sentencepiece_model(path: Path) -> dict[str, Any]:
    """The parts of a SentencePiece model the conversion needs: pieces (piece, score, type), model type, byte
    fallback, whitespace options, the precompiled character map and the unknown surface. ValueError naming the
    file when it cannot be read."""
    try:
        pieces = []
        trainer: dict[int, Any] = {}
        normalizer: dict[int, Any] = {}
        for number, _, value in _fields(path.read_bytes()):
            if number == 1:
                pieces.append(_piece(value))
            elif number == 2:
                trainer = {field: item for field, _, item in _fields(value)}
            elif number == 3:
                normalizer = {field: item for field, _, item in _fields(value)}
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a readable SentencePiece model ({error})") from error
    surface = trainer.get(44)
    return {
        "pieces": pieces,
        "model_type": _MODEL_TYPES.get(trainer.get(3, 1), str(trainer.get(3))),
        "byte_fallback": bool(trainer.get(35, 0)),
        "treat_whitespace_as_suffix": bool(trainer.get(24, 0)),
        "unk_surface": surface.decode("utf-8") if surface is not None else " \u2047 ",
        "charsmap": normalizer.get(2, b""),
        "add_dummy_prefix": bool(normalizer.get(3, 1)),
        "remove_extra_whitespaces": bool(normalizer.get(4, 1)),
        "escape_whitespaces": bool(normalizer.get(5, 1)),
    }
