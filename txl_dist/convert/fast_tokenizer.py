"""A txl_dist tokenizer as a `tokenizers` fast tokenizer (tokenizer.json + tokenizer_config.json for transformers).

The file is written as JSON by this module, so converting needs neither `tokenizers` nor `transformers` (the
SentencePiece model is read by `txl_dist.convert.sentencepiece_model`, through sentencepiece's own protobuf
module). It encodes the ids of
`txl_dist.tokenizer`, end-of-sentence handling included:

    tokenizer(text).input_ids == [eod_id] + ids of the lines of text joined by eos_id
                              == [eod_id] + txl_tokenizer.encode_document(text)[:-1]

that is, a text is read as the start of a document (after the separator that precedes every document in the
training stream, as `txl_dist.generate` reads a prompt), and a line break is the end-of-sentence token. The
leading eod is the post-processor's special token: ``add_special_tokens=False`` leaves it out. Decoding turns the
separators back into line breaks (as `Tokenizer.decode_document` does; one at the very start or end is dropped).

- ``word``: a WordLevel model over ``vocab.txt``; text is split on the characters Python's ``str.split()`` splits
  on; a line break becomes the eos word (so the word ``<eos>`` written in the text is eos too, as in txl_dist).
- ``sentencepiece``: the SentencePiece model's pieces and scores as a Unigram model, or its merges as a BPE model,
  with its normaliser (the precompiled character map, whitespace trimming, the dummy prefix, "▁" for spaces). A
  line break splits the text before normalisation, so every line is normalised on its own as txl_dist does. The
  eos piece is named "\\n" in the fast tokenizer (the line break it stands for). In a Unigram model the pieces
  SentencePiece never matches in text (unknown, control, unused) get names that contain a space, which no
  normalised text does, so the lattice cannot match them either; the unknown piece is named by the model's
  ``unk_surface`` (" ⁇ "), which is also how SentencePiece decodes it.

transformers registers the tokens it is told are special (here bos = eos = pad = the eod token) and cuts them out of
raw text before anything else. So the one place where ids can differ from txl_dist's is text that holds the eod
token's string glued to other characters (e.g. "word<eod>"), which txl_dist reads as part of a word.

- ``char``: the characters as the vocabulary, each character of the text its own pre-token (a Split on any
  single character, newlines included); the newline is the eos = eod id 0. A character outside the alphabet is an
  error, as in txl_dist: the model is a BPE model without merges whose unk token, which has no id, says so
  (tokenizers raises ``Unk token `a character outside the alphabet ...` not found in the vocabulary``).
- ``byte``: GPT-2's ByteLevel mapping of each UTF-8 byte to a printable character, then a BPE model without
  merges whose vocabulary maps the character of byte b to id b: the ids are the text's UTF-8 bytes, the newline
  byte (10) being eos = eod (where the ids are listed, as the authors' enwik8 vocabulary, the character of each
  listed byte maps to its id, and a byte not listed is an error). Decoding maps them back to bytes (bytes that
  are not UTF-8 become U+FFFD: text cannot hold them). The eod token is named by byte 10's ByteLevel character
  "Ċ" (U+010A), so that character written in the text is read as a newline (its own UTF-8 bytes are 0xC4 0x8A
  in txl_dist).

The rules of a tokenizer (`txl_dist.tokenizer.rules`, the authors' vocabularies) are kept: lower-casing as a
Lowercase normaliser, a line_start word after every line break and after the leading eod (the template), dropped
line breaks as a normaliser that removes them (the eod, then a space, leads the text).

What cannot be expressed is refused with a `FastTokenizerError` naming the file and the setting: SentencePiece
models of type word or char, byte fallback, whitespace as suffix, unescaped whitespace, BPE models with unused
pieces.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from txl_dist.convert.sentencepiece_model import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    read_sentencepiece_model,
)
from txl_dist.convert.tokenizer_json import (
    STRIP_LEADING_SPACE,
    STRIP_OUTER_SEPARATORS,
    added_token,
    document_config,
    document_template,
    python_whitespace_class,
    regex_escape,
    replace_step,
)
from txl_dist.tokenizer import ByteTokenizer, CharTokenizer, SentencePieceTokenizer, Tokenizer, WordTokenizer


class FastTokenizerError(ValueError):
    """A tokenizer that the fast-tokenizer format cannot reproduce; the message names the file and the setting."""


def _word_tokenizer(tokenizer: WordTokenizer) -> tuple[dict[str, Any], str]:
    words = tokenizer.words
    eos, eod = words[tokenizer.eos_id], words[tokenizer.eod_id]
    # Without an unk id an unknown word must be an error, as in txl_dist: name an unk token that cannot be a word.
    unk = words[tokenizer.unk_id] if tokenizer.unk_id is not None else "\n"
    separators = [replace_step(f"^{regex_escape(piece)}$", "\n", regex=True) for piece in dict.fromkeys([eos, eod])]
    # Its rules (the authors' vocabularies): lower-casing first; a line_start word after every line break, and
    # after the document separator (the template's second token).
    line_start = tokenizer.rules.line_start
    normalizers = [{"type": "Lowercase"}] if tokenizer.rules.lower_case else []
    normalizers.append(replace_step("\n", f" {eos} {line_start} " if line_start else f" {eos} "))
    template = document_template(eod, tokenizer.eod_id, line_start, tokenizer.line_prefix()[0] if line_start else None)
    data = _tokenizer_json(
        [added_token(tokenizer.eod_id, eod, special=True)],
        normalizers[0] if len(normalizers) == 1 else {"type": "Sequence", "normalizers": normalizers},
        {
            "type": "Split",
            "pattern": {"Regex": python_whitespace_class() + "+"},
            "behavior": "Removed",
            "invert": False,
        },
        template,
        # Words joined by single spaces, separators as line breaks without spaces around them.
        separators
        + [
            {"type": "WordPiece", "prefix": " ", "cleanup": False},
            {"type": "Fuse"},
            replace_step(" ?\n ?", "\n", regex=True),
            STRIP_OUTER_SEPARATORS,
        ],
        {"type": "WordLevel", "vocab": {word: i for i, word in enumerate(words)}, "unk_token": unk},
    )
    return data, eod


def _check_sentencepiece(model: dict[str, Any], path: Path) -> None:
    problems = []
    if model["model_type"] not in ("unigram", "bpe"):
        problems.append(f"model type {model['model_type']!r} (only unigram and bpe have a fast-tokenizer model)")
    if model["byte_fallback"] or any(p["type"] == BYTE for p in model["pieces"]):
        problems.append("byte_fallback=true")
    if model["treat_whitespace_as_suffix"]:
        problems.append("treat_whitespace_as_suffix=true")
    if not model["escape_whitespaces"]:
        problems.append("escape_whitespaces=false")
    if model["model_type"] == "bpe" and any(p["type"] == UNUSED for p in model["pieces"]):
        problems.append("unused pieces in a bpe model")
    if problems:
        raise FastTokenizerError(f"{path}: cannot be expressed as a fast tokenizer: {'; '.join(problems)}")


def _piece_names(model: dict[str, Any], eos_id: int, path: Path) -> list[str]:
    """The fast tokenizer's name of every piece: eos is "\\n"; in a Unigram model the pieces that text never
    matches (unknown, control, unused) get names with a space in them."""
    pieces = model["pieces"]
    names = [p["piece"] for p in pieces]
    names[eos_id] = "\n"
    if model["model_type"] == "unigram":
        for i, p in enumerate(pieces):
            if i == eos_id or p["type"] in (NORMAL, USER_DEFINED):
                continue
            name = model["unk_surface"] if p["type"] == UNKNOWN else f" {p['piece']} "
            names[i] = name if " " in name else f" {name} "
        if len(set(names)) != len(names):
            raise FastTokenizerError(f"{path}: renaming the special pieces made two pieces alike ({names[:8]}...)")
    return names


def _sentencepiece_normalizer(model: dict[str, Any]) -> dict[str, Any]:
    normalizers: list[dict[str, Any]] = []
    if model["charsmap"]:
        normalizers.append(
            {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(model["charsmap"]).decode("ascii")}
        )
    if model["remove_extra_whitespaces"]:
        normalizers += [replace_step("^ +| +$", "", regex=True), replace_step(" {2,}", " ", regex=True)]
    if model["add_dummy_prefix"]:
        normalizers.append({"type": "Prepend", "prepend": " "})
    normalizers.append(replace_step(" ", "\u2581"))
    return {"type": "Sequence", "normalizers": normalizers}


def _unigram_model(pieces: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    normal_scores = [p["score"] for p in pieces if p["type"] == NORMAL]
    max_score = max(normal_scores) if normal_scores else 0.0
    vocab = []
    for name, p in zip(names, pieces):
        # SentencePiece scores a user-defined symbol so that its lattice always prefers it.
        score = len(p["piece"]) * max_score - 0.1 if p["type"] == USER_DEFINED else p["score"]
        vocab.append([name, score])
    unk_ids = [i for i, p in enumerate(pieces) if p["type"] == UNKNOWN]
    return {"type": "Unigram", "unk_id": unk_ids[0] if unk_ids else None, "vocab": vocab, "byte_fallback": False}


def _bpe_model(pieces: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The BPE model whose merges, in the order of the pieces' scores, build every normal piece."""
    normal = {p["piece"] for p in pieces if p["type"] == NORMAL}
    ranked = sorted(
        (i for i, p in enumerate(pieces) if p["type"] == NORMAL and len(p["piece"]) > 1),
        key=lambda i: (-pieces[i]["score"], i),
    )
    merges = []
    for i in ranked:
        piece = pieces[i]["piece"]
        for cut in range(1, len(piece)):
            if piece[:cut] in normal and piece[cut:] in normal:
                merges.append([piece[:cut], piece[cut:]])
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": next((names[i] for i, p in enumerate(pieces) if p["type"] == UNKNOWN), None),
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": {name: i for i, name in enumerate(names)},
        "merges": merges,
    }


def _sentencepiece_decoders(model: dict[str, Any], names: list[str], tokenizer: SentencePieceTokenizer) -> list[dict]:
    """The decoders of SentencePiece's decode, line by line: the renamed pieces back to what SentencePiece decodes
    them to, eod to a line break, then "▁" to a space, except the "▁" that SentencePiece drops at a line's start.

    A control piece decodes to nothing, but only once the separators at the very start and end are gone: until
    then it is a character that no piece holds, so that a separator before or after one (``</s> <s>``) is not
    taken for the text's first or last token."""
    pieces = model["pieces"]
    control = _unused_character([p["piece"] for p in pieces] + [model["unk_surface"]], tokenizer.directory)
    decoders = []
    unk_id = next((i for i, p in enumerate(pieces) if p["type"] == UNKNOWN), None)
    if unk_id is not None and names[unk_id] != model["unk_surface"]:
        decoders.append(replace_step(f"\\A{regex_escape(names[unk_id])}\\z", model["unk_surface"], regex=True))
    if tokenizer.eod_id != tokenizer.eos_id:
        decoders.append(replace_step(f"\\A{regex_escape(names[tokenizer.eod_id])}\\z", "\n", regex=True))
    for i, p in enumerate(pieces):
        if p["type"] == CONTROL and i not in (tokenizer.eos_id, tokenizer.eod_id):
            decoders.append(replace_step(f"\\A{regex_escape(names[i])}\\z", control, regex=True))
    decoders += [{"type": "Fuse"}, STRIP_OUTER_SEPARATORS, replace_step(control, "")]
    if model["add_dummy_prefix"] or model["remove_extra_whitespaces"]:
        decoders.append(replace_step(_line_start_spaces(pieces), "", regex=True))
    decoders.append(replace_step("\u2581", " "))
    return decoders


def _unused_character(texts: list[str], where: Path) -> str:
    """A Unicode noncharacter that none of ``texts`` holds (text never should; the check makes it certain)."""
    used = set("".join(texts))
    for character in [*map(chr, range(0xFDD0, 0xFDF0)), "\ufffe", "\uffff"]:
        if character not in used:
            return character
    raise FastTokenizerError(f"{where}: its pieces hold every Unicode noncharacter; the decoder needs one they do not")


def _line_start_spaces(pieces: list[dict[str, Any]]) -> str:
    """The "▁" that SentencePiece's decode drops at the start of a line: while its text is empty, each piece loses
    one leading "▁" (a piece that is "▁" alone gives nothing and the next one loses its own), and the unknown
    piece's surface is kept whole (the decoders have given it with spaces, not "▁"). When no piece holds "▁▁" (a
    model that removes extra whitespace), every "▁" of the run that starts a line belongs to one piece there, so
    the whole run goes; otherwise the pieces cannot be told apart once fused, and one "▁" goes (exact for a line
    of one piece)."""
    run = "+" if not any("\u2581\u2581" in p["piece"] for p in pieces) else ""
    return f"\\A\u2581{run}|(?<=\n)\u2581{run}"


def _sentencepiece_tokenizer(tokenizer: SentencePieceTokenizer) -> tuple[dict[str, Any], str]:
    path = tokenizer.directory / tokenizer.files[0]
    try:
        model = read_sentencepiece_model(path)
    except ValueError as error:
        raise FastTokenizerError(str(error)) from error
    _check_sentencepiece(model, path)
    pieces = model["pieces"]
    if len(pieces) != tokenizer.vocab_size:
        raise FastTokenizerError(
            f"{path}: {len(pieces)} pieces, but its tokenizer.json says vocab_size={tokenizer.vocab_size}"
        )
    names = _piece_names(model, tokenizer.eos_id, path)
    eod = names[tokenizer.eod_id]
    eod_is_eos = tokenizer.eod_id == tokenizer.eos_id
    added = [added_token(tokenizer.eos_id, "\n", special=eod_is_eos)]
    if not eod_is_eos:
        added.append(added_token(tokenizer.eod_id, eod, special=True))
    if model["model_type"] == "unigram":
        model_json = _unigram_model(pieces, names)
    else:
        model_json = _bpe_model(pieces, names)
        # BPE cannot hold a user-defined symbol whole: they are cut out of the text first.
        added += [
            added_token(i, names[i], special=False)
            for i, p in enumerate(pieces)
            if p["type"] == USER_DEFINED and i not in (tokenizer.eos_id, tokenizer.eod_id)
        ]
    data = _tokenizer_json(
        sorted(added, key=lambda token: token["id"]),
        _sentencepiece_normalizer(model),
        None,
        document_template(eod, tokenizer.eod_id),
        _sentencepiece_decoders(model, names, tokenizer),
        model_json,
    )
    return data, eod


CHAR_OUTSIDE_ALPHABET = "a character outside the alphabet of this char tokenizer, which has no unknown token"
"""The char tokenizer's unk token, which is not in its vocabulary: tokenizers' error on text outside the alphabet
names it (``Unk token `a character outside ...` not found in the vocabulary``)."""


def _char_tokenizer(tokenizer: CharTokenizer) -> tuple[dict[str, Any], str]:
    characters = tokenizer.characters
    eod = characters[tokenizer.eod_id]  # the newline, eos = eod (or the space, where line breaks are dropped)
    data = _tokenizer_json(
        [added_token(tokenizer.eod_id, eod, special=True)],
        replace_step("\n", "") if tokenizer.rules.drops_line_breaks else None,
        {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False},
        document_template(eod, tokenizer.eod_id),
        [{"type": "Fuse"}, STRIP_LEADING_SPACE if tokenizer.rules.drops_line_breaks else STRIP_OUTER_SEPARATORS],
        # No unknown character, as in txl_dist: the unk token named is not in the vocabulary, so such text is an
        # error. A BPE model (without merges, so each one-character pre-token is looked up whole) because its error
        # names that token, which says what happened; WordLevel's says "Missing [UNK] token from the vocabulary".
        _bpe_without_merges({c: i for i, c in enumerate(characters)}, unk_token=CHAR_OUTSIDE_ALPHABET),
    )
    return data, eod


def byte_level_characters() -> list[str]:
    """GPT-2's printable stand-in for each byte value (the ByteLevel pre-tokenizer's table): printable Latin-1
    bytes stand for themselves, the others for U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for value in range(256):
        if value in printable:
            table[value] = chr(value)
        else:
            table[value] = chr(256 + extra)
            extra += 1
    return [table[value] for value in range(256)]


BYTE_OUTSIDE_VOCABULARY = "a byte outside the vocabulary of this byte tokenizer, which has no unknown token"
"""As `CHAR_OUTSIDE_ALPHABET`, for a byte tokenizer that lists some byte values only (the authors' enwik8)."""


def _byte_tokenizer(tokenizer: ByteTokenizer) -> tuple[dict[str, Any], str]:
    characters = byte_level_characters()
    values = tokenizer.decode_bytes(range(tokenizer.vocab_size))  # the byte of each id, in id order
    eod = characters[values[tokenizer.eod_id]]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    every_byte = tokenizer.vocab_size == 256
    data = _tokenizer_json(
        [added_token(tokenizer.eod_id, eod, special=True)],
        replace_step("\n", "") if tokenizer.rules.drops_line_breaks else None,
        byte_level,
        document_template(eod, tokenizer.eod_id),
        [byte_level, STRIP_LEADING_SPACE if tokenizer.rules.drops_line_breaks else STRIP_OUTER_SEPARATORS],
        _bpe_without_merges(
            {characters[value]: i for i, value in enumerate(values)},
            unk_token=None if every_byte else BYTE_OUTSIDE_VOCABULARY,
        ),
    )
    return data, eod


def _bpe_without_merges(vocab: dict[str, int], unk_token: str | None) -> dict[str, Any]:
    """A BPE model that maps each character of a pre-token to its id (``vocab`` holds single characters only)."""
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": unk_token,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [],
    }


def _tokenizer_json(
    added: list[dict],
    normalizer: dict | None,
    pre_tokenizer: dict | None,
    post_processor: dict,
    decoders: list[dict],
    model: dict,
) -> dict[str, Any]:
    """A tokenizers ``tokenizer.json`` document (format version 1.0, no truncation or padding)."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": model,
    }


def fast_tokenizer_files(tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """{file name: JSON content} of the fast tokenizer: tokenizer.json and tokenizer_config.json."""
    if isinstance(tokenizer, WordTokenizer):
        data, eod = _word_tokenizer(tokenizer)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        data, eod = _sentencepiece_tokenizer(tokenizer)
    elif isinstance(tokenizer, CharTokenizer):
        data, eod = _char_tokenizer(tokenizer)
    elif isinstance(tokenizer, ByteTokenizer):
        data, eod = _byte_tokenizer(tokenizer)
    else:
        raise FastTokenizerError(
            f"{tokenizer.directory}: tokenizer kind {tokenizer.kind!r} has no fast-tokenizer "
            f"form (supported: word, sentencepiece, char, byte)"
        )
    return {"tokenizer.json": data, "tokenizer_config.json": document_config(eod)}
