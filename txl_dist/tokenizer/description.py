"""``tokenizer.json``: writing it, checking a tokenizer directory against it, and loading the tokenizer it
describes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from txl_dist.fileio import atomic_write_text, read_json, sha256_files
from txl_dist.tokenizer.base import KINDS, TOKENIZER_JSON, Tokenizer, TokenizerError
from txl_dist.tokenizer.characters import ByteTokenizer, CharTokenizer
from txl_dist.tokenizer.rules import DEFAULT_RULES, RULES_FILE, read_rules
from txl_dist.tokenizer.words import SentencePieceTokenizer, WordTokenizer


def fingerprint_files(directory: str | os.PathLike, files: Sequence[str]) -> str:
    """sha256 of the bytes of ``files`` (names relative to ``directory``) in the order given."""
    paths = [Path(directory) / name for name in files]
    try:
        return sha256_files(paths)
    except OSError as error:
        raise TokenizerError(f"{error.filename}: cannot read tokenizer file ({error.strerror})") from error


_CLASSES = {cls.kind: cls for cls in (SentencePieceTokenizer, WordTokenizer, ByteTokenizer, CharTokenizer)}


def write_tokenizer_json(
    directory: str | os.PathLike,
    kind: str,
    files: list[str],
    vocab_size: int,
    eos_id: int,
    eod_id: int,
    unk_id: int | None,
    pieces: dict[str, str],
    training: dict[str, Any],
) -> Tokenizer:
    """Fingerprint the files, write ``tokenizer.json`` (atomically and last: it marks a complete directory) and
    load the result with the checks a user's `load_tokenizer` makes."""
    directory = Path(directory)
    description = {
        "kind": kind,
        "vocab_size": vocab_size,
        "files": files,
        "fingerprint": fingerprint_files(directory, files),
        "eos_id": eos_id,
        "eod_id": eod_id,
        "unk_id": unk_id,
        "pieces": pieces,
        "training": training,
    }
    atomic_write_text(directory / TOKENIZER_JSON, json.dumps(description, indent=1, ensure_ascii=False) + "\n")
    return load_tokenizer(directory)


def verified_fingerprint(directory: str | os.PathLike) -> str:
    """The fingerprint of a tokenizer directory, checked against its files (the checks of `load_tokenizer` up to
    the sha256), without reading the vocabulary into a tokenizer, which for a large word vocabulary takes far
    longer than the sha256. For a directory `load_tokenizer` has checked already; it does not check the
    description's vocabulary size and special ids against the vocabulary."""
    return _checked_description(directory).fingerprint


class _Description:
    """The contents of a directory's ``tokenizer.json``, read as a JSON object; `field` reads one key, checked."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.path = directory / TOKENIZER_JSON
        if not directory.is_dir():
            raise TokenizerError(f"{directory}: no such tokenizer directory")
        if not self.path.is_file():
            raise TokenizerError(f"{self.path}: missing; create a tokenizer with python -m data_tools.train_tokenizer")
        self.contents = read_json(self.path, TokenizerError, expect_object=True)
        self.files: list[str] = []
        self.fingerprint = ""

    def field(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self.contents:
            raise TokenizerError(f"{self.path}: missing key '{key}'")
        value = self.contents[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise TokenizerError(f"{self.path}: key '{key}' has the wrong type ({type(value).__name__})")
        return value


def _checked_description(directory: str | os.PathLike) -> _Description:
    """The description of a tokenizer directory, after checking its kind and files and that the files' sha256 is
    the recorded fingerprint (then in ``fingerprint``)."""
    description = _Description(Path(directory))
    directory, path = description.directory, description.path
    kind = description.field("kind", str)
    if kind not in _CLASSES:
        raise TokenizerError(f"{path}: key 'kind' is {kind!r}, expected one of {list(KINDS)}")
    files = description.field("files", list)
    if (
        not 1 <= len(files) <= 2
        or any(not isinstance(name, str) or Path(name).name != name for name in files)
        or (len(files) == 2 and files[1] != RULES_FILE)
    ):
        raise TokenizerError(
            f"{path}: key 'files' must list the vocabulary's file name, and {RULES_FILE!r} after it when the "
            f"tokenizer has rules, got {files!r}"
        )
    for name in files:
        if not (directory / name).is_file():
            raise TokenizerError(f"{directory / name}: missing tokenizer file (listed in {path})")
    recorded = description.field("fingerprint", str)
    actual = fingerprint_files(directory, files)
    if actual != recorded:
        raise TokenizerError(
            f"{directory / files[0]}: sha256 is {actual}, but {path} records fingerprint {recorded}; the file "
            f"changed after training (restore it, or retrain the tokenizer)"
        )
    description.files, description.fingerprint = files, actual
    return description


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer directory, checking ``tokenizer.json`` against the files it describes.

    Raises `TokenizerError` naming the file for a missing or damaged ``tokenizer.json`` or tokenizer file, a
    fingerprint that no longer matches the files, or special ids that disagree with the vocabulary.
    """
    description = _checked_description(directory)
    directory, path, field = description.directory, description.path, description.field
    vocab_size = field("vocab_size", int)
    eos_id, eod_id = field("eos_id", int), field("eod_id", int)
    unk_id = field("unk_id", (int, type(None)))
    kind = description.contents["kind"]
    rules = read_rules(directory / RULES_FILE, kind) if len(description.files) == 2 else DEFAULT_RULES
    tokenizer = _CLASSES[kind](
        directory, description.files, description.fingerprint, vocab_size, eos_id, eod_id, unk_id, rules
    )
    vocabulary = directory / description.files[0]
    if tokenizer._entries != vocab_size:
        raise TokenizerError(
            f"{path}: key 'vocab_size' is {vocab_size}, but {vocabulary} has {tokenizer._entries} entries"
        )
    pieces = field("pieces", dict)
    for name, token_id in (("eos", eos_id), ("eod", eod_id), ("unk", unk_id)):
        if token_id is None:
            continue
        if not 0 <= token_id < vocab_size:
            raise TokenizerError(f"{path}: key '{name}_id' is {token_id}, outside [0, {vocab_size})")
        if pieces.get(name) != tokenizer.id_to_piece(token_id):
            raise TokenizerError(
                f"{path}: '{name}_id' {token_id} is {tokenizer.id_to_piece(token_id)!r} in {vocabulary}, "
                f"but key 'pieces.{name}' says {pieces.get(name)!r}"
            )
    return tokenizer


def find_tokenizer_dir(fingerprint: str, candidates: Iterable[str | os.PathLike | None], strict: bool = False) -> Path:
    """The first candidate directory holding a tokenizer with ``fingerprint``.

    ``None`` candidates are skipped. Without ``strict`` a candidate that is missing, damaged or of another
    fingerprint is passed over; with ``strict`` it is an error. When none fits, the error names every candidate
    and why it was passed over.
    """
    passed_over = []
    for candidate in candidates:
        if candidate is None:
            continue
        directory = Path(candidate)
        try:
            found = load_tokenizer(directory).fingerprint  # the whole check: a copy to keep or convert with
        except TokenizerError as error:
            if strict:
                raise
            passed_over.append(str(error))
            continue
        if found == fingerprint:
            return directory
        problem = f"{directory}: fingerprint {found}, not the wanted {fingerprint}"
        if strict:
            raise TokenizerError(problem)
        passed_over.append(problem)
    raise TokenizerError(
        f"no tokenizer with fingerprint {fingerprint} among the candidates "
        f"({'; '.join(passed_over) or 'none given'}); pass its directory"
    )


def tokenizer_dir_of(path: str | os.PathLike) -> Path:
    """The tokenizer directory a path names: the path itself when it holds ``tokenizer.json``, else its
    ``tokenizer/`` folder when that does (an export folder, a training run folder, a transformers folder that
    export-to-hf wrote); otherwise the path as given, for `load_tokenizer` to name in its error."""
    path = Path(path)
    if not (path / TOKENIZER_JSON).is_file() and (path / "tokenizer" / TOKENIZER_JSON).is_file():
        return path / "tokenizer"
    return path
