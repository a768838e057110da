"""A SentencePiece model file read through the protobuf module SentencePiece ships (`sentencepiece_model_pb2`): the
pieces, their scores and types, and the normaliser settings.

Protobuf parses what it can and keeps the rest aside: an empty file is an empty ModelProto, a string that is not
UTF-8 comes back as bytes, and an enum value outside its type (a piece type, the model type) or a field of the wrong
wire type lands among the message's unknown fields while the field reads its default. So the fields the conversion
reads are checked here, and such a file is refused as a ValueError naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from sentencepiece import sentencepiece_model_pb2

_Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (
    _Piece.NORMAL,
    _Piece.UNKNOWN,
    _Piece.CONTROL,
    _Piece.USER_DEFINED,
    _Piece.UNUSED,
    _Piece.BYTE,
)
"""The piece types of ModelProto.SentencePiece.Type (1 to 6)."""
_MODEL_TYPES = {value: name.lower() for name, value in sentencepiece_model_pb2.TrainerSpec.ModelType.items()}

_READ = {
    "ModelProto": ("pieces", "trainer_spec", "normalizer_spec"),
    "SentencePiece": ("piece", "score", "type"),
    "TrainerSpec": ("model_type", "byte_fallback", "treat_whitespace_as_suffix", "unk_surface"),
    "NormalizerSpec": ("precompiled_charsmap", "add_dummy_prefix", "remove_extra_whitespaces", "escape_whitespaces"),
}
"""The fields the conversion reads, by message type."""


def _check(message: Message, where: str) -> None:
    """ValueError when a field of MESSAGE that the conversion reads went to the unknown fields (an enum value
    outside its type, or the wrong wire type) or holds a string that is not UTF-8."""
    fields = message.DESCRIPTOR.fields_by_name
    numbers = {fields[name].number: fields[name] for name in _READ[message.DESCRIPTOR.name]}
    for unknown in UnknownFieldSet(message):
        field = numbers.get(unknown.field_number)
        if field is None:
            continue
        if field.enum_type is not None and unknown.wire_type == 0:
            raise ValueError(f"{where}{field.name} is {unknown.data}, no value of {field.enum_type.full_name}")
        raise ValueError(f"{where}{field.name} has the wrong wire type ({unknown.wire_type})")
    for field in numbers.values():
        if field.type == field.TYPE_STRING and not isinstance(getattr(message, field.name), str):
            raise ValueError(f"{where}{field.name} is not UTF-8")


def read_sentencepiece_model(path: Path) -> dict[str, Any]:
    """The parts of a SentencePiece model the conversion needs: pieces (piece, score, type), model type, byte
    fallback, whitespace options, the precompiled character map and the unknown surface. ValueError naming the
    file when it cannot be read."""
    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())
        _check(model, "")
        if not model.pieces:
            raise ValueError("no pieces")
        for i, piece in enumerate(model.pieces):
            _check(piece, f"piece {i}: ")
        _check(model.trainer_spec, "trainer_spec.")
        _check(model.normalizer_spec, "normalizer_spec.")
    except (DecodeError, ValueError) as error:  # UnicodeDecodeError (pure-Python protobuf) is a ValueError
        raise ValueError(f"{path}: not a readable SentencePiece model ({error})") from error
    trainer, normalizer = model.trainer_spec, model.normalizer_spec
    return {
        "pieces": [{"piece": p.piece, "score": p.score, "type": p.type} for p in model.pieces],
        "model_type": _MODEL_TYPES[trainer.model_type],
        "byte_fallback": trainer.byte_fallback,
        "treat_whitespace_as_suffix": trainer.treat_whitespace_as_suffix,
        "unk_surface": trainer.unk_surface,
        "charsmap": normalizer.precompiled_charsmap,
        "add_dummy_prefix": normalizer.add_dummy_prefix,
        "remove_extra_whitespaces": normalizer.remove_extra_whitespaces,
        "escape_whitespaces": normalizer.escape_whitespaces,
    }
