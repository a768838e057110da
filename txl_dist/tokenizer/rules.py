"""``rules.json``: how a tokenizer reads text where it departs from its kind's defaults.

A tokenizer directory may list a second file, ``rules.json``, after its vocabulary. Its settings change which
ids a text becomes, so they are part of the fingerprint (the sha256 of the listed files, in order). Tokenizers
that `data_tools.train_tokenizer` makes have none; the vocabularies of the authors' released models do
(`txl_dist.convert.authors_vocab`), whose ``vocabulary.py`` reads text thus:

- ``lower_case`` (word): the text is lower-cased (Python's ``str.lower``) before it is split; their PTB setting.
- ``line_start`` (word): a piece of the vocabulary put before every line, as their One Billion Word data frames
  each sentence ``<S> ... <S>`` (the separator is then ``<S>`` too).
- ``line_breaks`` (byte, char): ``"separator"`` (the default: the newline is a token, ``eos_id = eod_id``) or
  ``"dropped"``: a line break gives no token and the lines of a document run together, as their enwik8 and
  text8 data (``add_eos=False``); a document then ends with ``eod_id``, a character of the alphabet (a space).
- ``ids`` (byte): ``"byte_values"`` (the default: id = the byte's value, all 256) or ``"listed"``: the ids
  follow ``bytes.txt``'s order, which may list any of the byte values once each (their enwik8 vocabulary: 204
  bytes ordered by frequency); a byte it does not list is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

from txl_dist.fileio import atomic_write_text
from txl_dist.tokenizer.base import DEFAULT_RULES, ReadingRules, TokenizerError

__all__ = ["DEFAULT_RULES", "RULES_FILE", "ReadingRules", "read_rules", "write_rules"]

RULES_FILE = "rules.json"

_KEYS_OF_KIND = {
    "word": ("lower_case", "line_start"),
    "byte": ("line_breaks", "ids"),
    "char": ("line_breaks",),
    "sentencepiece": (),
}
_CHOICES = {"line_breaks": ("separator", "dropped"), "ids": ("byte_values", "listed")}


def read_rules(path: Path, kind: str) -> ReadingRules:
    """The rules of ``path`` for a tokenizer of ``kind``; a key another kind uses, an unknown key or a bad value
    is a `TokenizerError` naming the file and the key."""
    try:
        contents = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"{path}: cannot read the tokenizer's rules ({error})") from error
    if not isinstance(contents, dict):
        raise TokenizerError(f"{path}: expected a JSON object of rules, got {type(contents).__name__}")
    allowed = _KEYS_OF_KIND[kind]
    for key, value in contents.items():
        if key not in allowed:
            raise TokenizerError(
                f"{path}: key {key!r} is no rule of a {kind} tokenizer (its rules: {list(allowed) or 'none'})"
            )
        if key == "lower_case" and not isinstance(value, bool):
            raise TokenizerError(f"{path}: key 'lower_case' must be true or false, got {value!r}")
        if key == "line_start" and not (isinstance(value, str) and value and not any(c.isspace() for c in value)):
            raise TokenizerError(f"{path}: key 'line_start' must be a piece of the vocabulary, got {value!r}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise TokenizerError(f"{path}: key {key!r} is {value!r}, expected one of {list(_CHOICES[key])}")
    return ReadingRules(**contents)


def write_rules(directory: Path, rules: ReadingRules) -> list[str]:
    """Write ``rules.json`` when ``rules`` differ from the defaults; the file names to list after the
    vocabulary (none or ``[RULES_FILE]``)."""
    settings = rules.to_json()
    if not settings:
        return []
    atomic_write_text(directory / RULES_FILE, json.dumps(settings, indent=1, sort_keys=True) + "\n")
    return [RULES_FILE]
