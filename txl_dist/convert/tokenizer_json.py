"""The building blocks of a `tokenizers` tokenizer.json and its tokenizer_config.json that every kind of txl_dist
tokenizer shares (`txl_dist.convert.fast_tokenizer` puts them together per kind): escaped patterns, Replace steps,
added tokens, the post-processor that opens a document, and the document's special tokens.
"""

from __future__ import annotations

from typing import Any

_REGEX_SPECIALS = set("\\^$.|?*+()[]{}")


def regex_escape(text: str) -> str:
    """Escape for the Oniguruma regular expressions of `tokenizers` (only the metacharacters)."""
    return "".join("\\" + c if c in _REGEX_SPECIALS else c for c in text)


def python_whitespace_class() -> str:
    """An Oniguruma character class of exactly the characters Python's ``str.split()`` splits on (it differs from
    Unicode's White_Space: e.g. U+001C..U+001F are whitespace to Python)."""
    chars = [chr(c) for c in range(0x110000) if chr(c).isspace()]
    return "[" + "".join("\\" + c if c in "\\]^-[" else c for c in chars) + "]"


def replace_step(pattern: str, content: str, regex: bool = False) -> dict[str, Any]:
    return {"type": "Replace", "pattern": {"Regex" if regex else "String": pattern}, "content": content}


# A separator before the first line (the document start) or after the last is not a line break of the text
# (txl_dist's decode_document). Not a Strip decoder: tokenizers' Strip panics on a text shorter than what it
# strips ("\n" alone, or nothing), which is what a lone separator or an empty sequence decodes to. \A and \z, not
# ^ and $, which Oniguruma reads as the start and end of any line.
STRIP_OUTER_SEPARATORS = replace_step("\\A\n|\n\\z", "", regex=True)
# Where line breaks are dropped, the separator is a space: the one the document starts with is not the text's.
STRIP_LEADING_SPACE = replace_step("\\A ", "", regex=True)


def added_token(token_id: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def document_template(bos: str, bos_id: int, start: str | None = None, start_id: int | None = None) -> dict[str, Any]:
    """The post-processor that puts the document separator before a text (and before each text of a pair), and
    ``start`` after it where every line begins with a token (a word tokenizer's line_start rule)."""
    first = [{"SpecialToken": {"id": bos, "type_id": 0}}]
    second = [{"SpecialToken": {"id": bos, "type_id": 1}}]
    tokens = {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}
    if start is not None:
        first.append({"SpecialToken": {"id": start, "type_id": 0}})
        second.append({"SpecialToken": {"id": start, "type_id": 1}})
        tokens[start] = {"id": start, "ids": [start_id], "tokens": [start]}
    return {
        "type": "TemplateProcessing",
        "single": [*first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [*first, {"Sequence": {"id": "A", "type_id": 0}}, *second, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": tokens,
    }


def document_config(eod: str) -> dict[str, Any]:
    """tokenizer_config.json: the eod token as bos, eos and pad (a document's start and end, and the padding of
    left-padded batches)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod,
        "eos_token": eod,
        "pad_token": eod,
        "padding_side": "left",
        # Decoding must give back the words as they are (no "said ." -> "said." rewriting).
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
