"""txl_dist.convert.sentencepiece_model: a SentencePiece model reads as SentencePiece loads it, and a file protobuf
parses without complaint but that holds no usable model (empty, an enum value outside its type, a string that is
not UTF-8, a field of the wrong wire type) is refused as one line naming the file, as a damaged one is."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import sentencepiece
import treebank
from sentencepiece import sentencepiece_model_pb2

from txl_dist.convert.sentencepiece_model import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    read_sentencepiece_model,
)


def _train(**settings) -> bytes:
    lines = [line for line in treebank.penn["train"].split("\n")[:1500] if line.strip()]
    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buffer, minloglevel=2, **{"vocab_size": 200, **settings}
    )
    return buffer.getvalue()


@pytest.fixture(scope="module")
def unigram() -> bytes:
    return _train(user_defined_symbols=["<eod>"], control_symbols=["<ctl>"])


@pytest.mark.parametrize("settings", [{}, {"model_type": "bpe", "byte_fallback": True, "vocab_size": 400}])
def test_a_model_reads_as_sentencepiece_loads_it(tmp_path, unigram, settings):
    path = tmp_path / "spm.model"
    path.write_bytes(_train(**settings) if settings else unigram)
    model = read_sentencepiece_model(path)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    assert len(model["pieces"]) == processor.get_piece_size()
    for i, piece in enumerate(model["pieces"]):
        assert piece["piece"] == processor.id_to_piece(i)
        assert piece["score"] == processor.get_score(i)
        kinds = [
            (UNKNOWN, processor.is_unknown(i)),
            (CONTROL, processor.is_control(i)),
            (UNUSED, processor.is_unused(i)),
            (BYTE, processor.is_byte(i)),
        ]
        # SentencePiece has no is_user_defined: a piece of none of these kinds is normal or user-defined.
        expected = next((kind for kind, yes in kinds if yes), USER_DEFINED if piece["piece"] == "<eod>" else NORMAL)
        assert piece["type"] == expected, (i, piece)
    types = {p["type"] for p in model["pieces"]}
    assert {NORMAL, UNKNOWN, CONTROL} <= types
    assert (USER_DEFINED in types) == (not settings) and (BYTE in types) == bool(settings)
    assert model["model_type"] == settings.get("model_type", "unigram")
    assert model["byte_fallback"] is bool(settings)
    assert model["treat_whitespace_as_suffix"] is False
    assert model["unk_surface"] == " \u2047 "
    assert isinstance(model["charsmap"], bytes) and model["charsmap"]
    assert model["add_dummy_prefix"] is model["remove_extra_whitespaces"] is model["escape_whitespaces"] is True


def test_settings_away_from_the_defaults_are_read(tmp_path, unigram):
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(unigram)
    proto.trainer_spec.model_type = proto.trainer_spec.WORD
    proto.trainer_spec.treat_whitespace_as_suffix = True
    proto.trainer_spec.unk_surface = "<?>"
    proto.normalizer_spec.precompiled_charsmap = b""
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.escape_whitespaces = False
    path = tmp_path / "spm.model"
    path.write_bytes(proto.SerializeToString())
    model = read_sentencepiece_model(path)
    assert model["model_type"] == "word" and model["treat_whitespace_as_suffix"] is True
    assert model["unk_surface"] == "<?>" and model["charsmap"] == b""
    assert (model["add_dummy_prefix"], model["remove_extra_whitespaces"], model["escape_whitespaces"]) == (
        False,
        True,
        False,
    )


def test_fields_it_does_not_read_are_let_through(tmp_path, unigram):
    """A field this sentencepiece_model_pb2 does not know (a newer SentencePiece's, say) is no error."""
    path = tmp_path / "spm.model"
    path.write_bytes(unigram)
    expected = read_sentencepiece_model(path)
    # ModelProto field 100 (a varint) and TrainerSpec field 100 (bytes), both unknown.
    path.write_bytes(unigram + b"\xa0\x06\x01" + b"\x12\x05\xa2\x06\x02hi")
    assert read_sentencepiece_model(path) == expected


def _piece(body: bytes) -> bytes:
    """ModelProto field 1 (a piece) holding BODY."""
    return b"\x0a" + bytes([len(body)]) + body


_PIECE = _piece(b"\x0a\x01a\x15\x00\x00\x80\xbf")  # piece "a", score -1.0
_BAD = {
    "empty": (b"", "no pieces"),
    "no pieces": (b"\x12\x02\x18\x02", "no pieces"),  # a trainer_spec (model type bpe) alone
    "text": (b"hello, world\n", "Error parsing message|end-group tag"),
    "truncated": (None, "Error parsing message|Truncated message"),
    "garbage before the model": (None, "Error parsing message|Field number 0 is illegal"),
    "piece type 7": (_piece(b"\x0a\x01a\x18\x07"), "piece 0: type is 7, no value of .*SentencePiece.Type"),
    "model type 9": (_PIECE + b"\x12\x02\x18\x09", "trainer_spec.model_type is 9, no value of .*ModelType"),
    "piece not UTF-8": (_piece(b"\x0a\x01\xff"), "piece 0: piece is not UTF-8|invalid start byte"),
    "unk_surface not UTF-8": (_PIECE + b"\x12\x04\xe2\x02\x01\xff", "unk_surface is not UTF-8|invalid start byte"),
    "pieces as a varint": (b"\x08\x05", r"pieces has the wrong wire type \(0\)"),
    "piece string as a varint": (_piece(b"\x08\x01"), r"piece 0: piece has the wrong wire type \(0\)"),
    "score as a varint": (_piece(b"\x0a\x01a\x10\x05"), r"piece 0: score has the wrong wire type \(0\)"),
    "bool as bytes": (_PIECE + b"\x1a\x03\x1a\x01x", r"normalizer_spec.add_dummy_prefix has the wrong wire type \(2\)"),
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_a_file_that_holds_no_usable_model_is_refused_naming_it(tmp_path, unigram, case):
    data, why = _BAD[case]
    if case == "truncated":
        data = unigram[: len(unigram) // 2]
    elif case == "garbage before the model":
        data = b"\x00garbage" + unigram[:100]  # as tests/test_tokenizer.py damages a model
    path = tmp_path / "spm.model"
    path.write_bytes(data)
    with pytest.raises(ValueError) as caught:
        read_sentencepiece_model(path)
    message = str(caught.value)
    assert "\n" not in message
    assert re.match(rf"{re.escape(str(path))}: not a readable SentencePiece model \((.*({why}).*)\)$", message), message


def test_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_sentencepiece_model(Path(tmp_path / "absent.model"))
