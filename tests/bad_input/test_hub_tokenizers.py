"""The tokenizers of the folders `convert.py export-to-hub` writes (txl_dist.convert.fast_tokenizer), run in current
transformers (.venv-hf: the hf tier, applied to this file in tests/conftest.py): every id and every short sequence
decodes, and short texts encode, as txl_dist's own tokenizers do, for word, BPE, unigram, byte and char models; text
outside a char model's alphabet is refused as txl_dist refuses it."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.test_hub_export import _tokenizer_only_folder, require_hf_python, run_hub_worker, unigram_tokenizer
from txl_dist.convert.fast_tokenizer import CHAR_OUTSIDE_ALPHABET
from txl_dist.tokenizer import ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.hf

assert unigram_tokenizer  # a fixture of test_hub_export, used here too


SHORT_TEXTS = ["", " ", "\n", "\n\n", " \n ", "a", " a", "a ", "a\n", "\na", "a\n\nb", "a  b", "the\n", "\n\nthe"]
"""Texts in every alphabet of these tokenizers (PTB's lower-case letters and the space)."""


OUTSIDE_THE_ALPHABET = ["é", "the café", "\x00", "日本"]


def hub_decoded(tokenizer, ids: list[int]) -> str:
    """What a hub folder's tokenizer must decode ``ids`` to: a text read as a document's start, after the
    separator the tokenizer puts first (txl_dist's ``decode_document`` of what follows it); bytes that are not
    UTF-8 as U+FFFD (a Rust string cannot hold them, and txl_dist keeps them as lone surrogates)."""
    body = ids[1:] if ids and ids[0] in (tokenizer.eos_id, tokenizer.eod_id) else ids
    text = tokenizer.decode_document(body)
    if isinstance(tokenizer, ByteTokenizer):
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return text


def short_sequences(tokenizer) -> list[list[int]]:
    """The empty sequence; every sequence of one to three ids among those where decoding has cases of its own
    (the separators, unknown and control pieces, "▁" alone, a piece with a leading "▁" and one without, a space,
    bytes that are not UTF-8 alone); 200 random sequences of two to six ids."""
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    cases = {tokenizer.eos_id, tokenizer.eod_id, *range(4)} | ({tokenizer.unk_id} - {None})
    cases |= {i for i, p in enumerate(pieces) if p in ("\u2581", " ", "<0x20>", "<0x61>", "<0x80>", "<0xC3>", "<0xA9>")}
    spaced = [i for i, p in enumerate(pieces) if p.startswith("\u2581") and len(p) > 1]
    plain = [i for i, p in enumerate(pieces) if i not in cases and p.isalpha()]
    cases |= set(spaced[:1] + plain[:1])
    rng = random.Random(27)
    sequences = [[]] + [list(ids) for length in (1, 2, 3) for ids in itertools.product(sorted(cases), repeat=length)]
    return sequences + [rng.choices(range(tokenizer.vocab_size), k=rng.randint(2, 6)) for _ in range(200)]


def _txl_ids(tokenizer, text: str) -> list[int] | str:
    """The ids a hub folder's tokenizer must give ``text`` (see txl_dist.convert.fast_tokenizer), or how
    txl_dist refuses it."""
    try:
        return [tokenizer.eod_id] + tokenizer.encode_document(text)[:-1]
    except ValueError as error:
        return f"refused: {error}"


@pytest.fixture(scope="module")
def decoding(tmp_path_factory, character_models, ptb_word_tokenizer, ptb_sentencepiece_tokenizer, unigram_tokenizer):
    """(txl_dist's tokenizer, what must come out, what the hub folder's tokenizer gave) per kind."""
    require_hf_python()
    root = tmp_path_factory.mktemp("hub_decoding")
    directories = {
        "word": ptb_word_tokenizer,
        "bpe": ptb_sentencepiece_tokenizer,
        "unigram": unigram_tokenizer,
        "byte": character_models["byte"]["tokenizer"],
        "char": character_models["char"]["tokenizer"],
    }
    jobs, expected, tokenizers = [], {}, {}
    for kind, directory in directories.items():
        tokenizer = tokenizers[kind] = load_tokenizer(directory)
        _tokenizer_only_folder(root / kind, tokenizer, root)
        sequences = short_sequences(tokenizer)
        refused = OUTSIDE_THE_ALPHABET if kind == "char" else []
        jobs.append(
            {
                "name": kind,
                "folder": str(root / kind),
                "vocab_size": tokenizer.vocab_size,
                "sequences": sequences,
                "texts": SHORT_TEXTS,
                "refused": refused,
            }
        )
        expected[kind] = {
            "singles": [hub_decoded(tokenizer, [i]) for i in range(tokenizer.vocab_size)],
            "sequences": [hub_decoded(tokenizer, ids) for ids in sequences],
            "texts": [_txl_ids(tokenizer, text) for text in SHORT_TEXTS],
            "refused": [_txl_ids(tokenizer, text) for text in refused],
        }
    results = run_hub_worker({"decoding": jobs}, root)["decoding"]
    return {kind: (tokenizers[kind], expected[kind], results[kind]) for kind in directories}


KINDS = ["word", "bpe", "unigram", "byte", "char"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_id_and_every_short_sequence_decodes_as_txl_dist_decodes(decoding, kind):
    """Before issue 27 a lone separator (``decode([10])`` of a byte folder, ``t.decode(t('')['input_ids'])``) or
    an empty sequence panicked in the Rust code of tokenizers (a Strip decoder on a one-character text)."""
    _, expected, found = decoding[kind]
    for what in ("singles", "sequences"):
        wrong = [(i, got, want) for i, (got, want) in enumerate(zip(found[what], expected[what])) if got != want]
        assert len(found[what]) == len(expected[what]) and not wrong, (what, len(wrong), wrong[:5])
    raised = [text for text in found["skipping_specials"] if isinstance(text, str) and text.startswith("raised ")]
    assert not raised, raised[:5]


@pytest.mark.parametrize("kind", KINDS)
def test_short_texts_give_txl_dist_ids(decoding, kind):
    _, expected, found = decoding[kind]
    assert found["texts"] == expected["texts"]


def test_the_char_folder_refuses_text_outside_its_alphabet_as_txl_dist_does_naming_why(decoding):
    _, expected, found = decoding["char"]
    for theirs, ours in zip(found["refused"], expected["refused"], strict=True):
        assert ours.startswith("refused: ") and "is not in the alphabet of" in ours, ours
        assert theirs == f"raised Exception: Unk token `{CHAR_OUTSIDE_ALPHABET}` not found in the vocabulary", theirs
