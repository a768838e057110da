"""The vocabulary of the authors' released models: their ``data/cache.pkl``, read without running it, written as a
txl_dist tokenizer whose ids are theirs.

``cache.pkl`` is a pickle (protocol 2, written by their ``tf/data_utils.py``) of their ``data_utils.Corpus``: the
``vocabulary.Vocab`` (``idx2sym``, ``sym2idx``, ``counter``, ``special``, ``lower_case``, ``delimiter``) and the
corpus's token arrays. A pickle names the classes to build and the functions to call; `read_cache` resolves
only these names, each to an inert stand-in of this module that stores what it is given and runs nothing:

- their ``Corpus`` and ``Vocab`` (modules ``data_utils``/``vocabulary``, or ``utils.vocabulary`` of their PyTorch
  code), as plain attribute holders;
- ``collections.Counter`` and ``collections.OrderedDict``, as dicts;
- numpy's array and dtype reconstruction (the corpus's token arrays), as placeholders that keep the shape and
  drop the bytes;
- ``copyreg._reconstructor`` and ``object`` (older pickle protocols), for the stand-ins above only, and
  ``_codecs.encode`` from latin-1 (how Python 3 writes bytes under protocol 2).

Any other global (``os.system``, a ``torch`` class, ...) is refused with one line naming it, before anything
of the pickle is used; so is a persistent id. The tokenizer is then built as their ``Vocab.tokenize`` reads
text, per dataset (their ``get_lm_corpus``):

- ``wt103``, ``wt2``, ``ptb``: a word tokenizer; every line ends with ``<eos>`` (blank lines too), ``<unk>`` is
  the unknown word where the vocabulary has it; ``ptb`` lower-cases (``lower_case``).
- ``lm1b``: a word tokenizer framing each line ``<S> ... <S>`` (their ``add_double_eos``), ``<UNK>`` unknown.
- ``enwik8``: a byte tokenizer with their ids (the vocabulary's symbols are byte values in decimal, ordered by
  frequency) whose line breaks give no token, as their data has none (their ``prep_enwik8.py`` writes each
  newline byte as a line break, which ``add_eos=False`` drops).
- ``text8``: a char tokenizer with their ids (``_`` is their symbol for the space), line breaks dropped.

For the character data a document ends with the space, the one separator their alphabet has.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from txl_dist.fileio import sha256_files
from txl_dist.tokenizer import (
    BYTE_VOCAB,
    CHAR_VOCAB,
    WORD_VOCAB,
    Tokenizer,
    byte_piece,
    char_piece,
    write_tokenizer_json,
    write_word_vocab,
)
from txl_dist.tokenizer.rules import ReadingRules, write_rules

WORD_DATASETS = ("wt103", "wt2", "ptb", "lm1b")
CHARACTER_DATASETS = ("enwik8", "text8")
DATASETS = WORD_DATASETS + CHARACTER_DATASETS
"""The datasets of the authors' ``get_lm_corpus``."""


class _Inert:
    """A stand-in for a class of the authors' code: it keeps the attributes the pickle gives it."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = state[0]
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"{type(self).__name__}: a state of {type(state).__name__}, not a dict")
        self.__dict__.update({_text(key): value for key, value in state.items()})


class AuthorsCorpus(_Inert):
    """Their ``data_utils.Corpus``."""


class AuthorsVocab(_Inert):
    """Their ``vocabulary.Vocab``."""


class _InertDict(dict):
    """``collections.Counter`` / ``OrderedDict``: built from a mapping or item by item, nothing more."""

    def __init__(self, *args: Any) -> None:
        super().__init__()
        if args and isinstance(args[0], Mapping):
            self.update(args[0])
        elif args and isinstance(args[0], list):  # Python 2's OrderedDict: a list of [key, value] pairs
            self.update((pair[0], pair[1]) for pair in args[0] if isinstance(pair, (list, tuple)) and len(pair) == 2)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.update(state)


class _InertArray:
    """A numpy array of the corpus (their token ids): its shape is kept, its bytes dropped."""

    shape: tuple = ()

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) >= 2 and isinstance(state[1], tuple):
            self.shape = state[1]


class _InertDType:
    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        pass


def _array(*args: Any) -> _InertArray:
    return _InertArray()


def _latin1(text: Any, encoding: str = "latin1") -> bytes:
    """``_codecs.encode``, as Python 3 pickles bytes under protocol 2 (numpy's array data): latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode of {type(text).__name__} as {encoding!r}")
    return text.encode("latin-1")


_STAND_INS = (AuthorsCorpus, AuthorsVocab, _InertDict)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` (pickle protocols 0 and 1) for the stand-ins only."""
    if cls not in _STAND_INS:
        raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r}")
    return cls.__new__(cls)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("data_utils", "Corpus"): AuthorsCorpus,
    ("vocabulary", "Vocab"): AuthorsVocab,
    ("utils.vocabulary", "Vocab"): AuthorsVocab,
    ("collections", "Counter"): _InertDict,
    ("collections", "OrderedDict"): _InertDict,
    ("numpy.core.multiarray", "_reconstruct"): _array,
    ("numpy._core.multiarray", "_reconstruct"): _array,
    ("numpy", "ndarray"): _InertArray,
    ("numpy", "dtype"): _InertDType,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("_codecs", "encode"): _latin1,
}


class _RefusingUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        # encoding="bytes": a Python 2 str stays bytes (their symbols are decoded as UTF-8 below; numpy's array
        # bytes are never decoded at all).
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        # Python 2's names (copy_reg, __builtin__, ...), as pickle's own find_class maps them for protocols < 3.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        stand_in = _ALLOWED.get((module, name))
        if stand_in is None:
            raise VocabularyPickleError(
                f"{self.path}: refused: the pickle asks for {module}.{name}, which is not part of the authors' "
                f"vocabulary (only their Corpus and Vocab, Counter, OrderedDict and numpy arrays are read); "
                f"nothing of it was run"
            )
        return stand_in

    def persistent_load(self, pid: Any) -> Any:
        raise VocabularyPickleError(f"{self.path}: refused: the pickle holds a persistent id ({pid!r}); nothing ran")


class VocabularyPickleError(ValueError):
    """A ``cache.pkl`` that is refused or cannot be read; the message names the file."""


def _text(value: Any) -> Any:
    """A Python 2 str (bytes here) as text; anything else as it is."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


@dataclasses.dataclass(frozen=True)
class AuthorsVocabulary:
    """What the tokenizer needs of their ``Vocab``."""

    symbols: list[str]
    counts: list[int]
    special: list[str]
    lower_case: bool
    delimiter: str | None
    unk: str | None
    dataset: str | None


def read_cache(path: str | Path) -> AuthorsVocabulary:
    """Their vocabulary from ``cache.pkl`` (see the module docstring); `VocabularyPickleError` for a refused or
    damaged file."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            loaded = _RefusingUnpickler(file, path).load()
    except VocabularyPickleError:
        raise
    except OSError as error:
        raise VocabularyPickleError(f"{path}: cannot read ({error.strerror or error})") from error
    except Exception as error:  # noqa: BLE001 - any damage of the bytes: pickle raises many kinds
        raise VocabularyPickleError(f"{path}: not a readable pickle ({type(error).__name__}: {error})") from error
    vocab = getattr(loaded, "vocab", loaded)
    if not isinstance(vocab, AuthorsVocab):
        raise VocabularyPickleError(
            f"{path}: holds a {type(loaded).__name__}, not the authors' Corpus or Vocab (their data_utils.py)"
        )
    return _vocabulary(path, vocab, getattr(loaded, "dataset", None))


def _vocabulary(path: Path, vocab: AuthorsVocab, dataset: Any) -> AuthorsVocabulary:
    fields = vocab.__dict__
    idx2sym = fields.get("idx2sym")
    if not isinstance(idx2sym, list) or not idx2sym:
        raise VocabularyPickleError(f"{path}: its Vocab has no list of symbols (idx2sym)")
    try:
        symbols = [_text(symbol) for symbol in idx2sym]
    except UnicodeDecodeError as error:
        raise VocabularyPickleError(f"{path}: a symbol of its vocabulary is not UTF-8 ({error})") from error
    bad = next((i for i, symbol in enumerate(symbols) if not isinstance(symbol, str) or not symbol), None)
    if bad is not None:
        raise VocabularyPickleError(f"{path}: symbol {bad} of its vocabulary is {symbols[bad]!r}, not a string")
    if len(set(symbols)) != len(symbols):
        raise VocabularyPickleError(f"{path}: its vocabulary lists a symbol twice")
    sym2idx = fields.get("sym2idx")
    if isinstance(sym2idx, dict) and {_text(k): v for k, v in sym2idx.items()} != {s: i for i, s in enumerate(symbols)}:
        raise VocabularyPickleError(f"{path}: its Vocab's sym2idx and idx2sym disagree")
    counter = fields.get("counter") if isinstance(fields.get("counter"), dict) else {}
    counter = {_text(key): value for key, value in counter.items()}
    counts = [int(counter.get(symbol, 0)) if isinstance(counter.get(symbol, 0), int) else 0 for symbol in symbols]
    unk = None
    unk_idx = fields.get("unk_idx")
    if isinstance(unk_idx, int) and 0 <= unk_idx < len(symbols):
        unk = symbols[unk_idx]
    elif "<unk>" in symbols:
        unk = "<unk>"
    delimiter = _text(fields.get("delimiter"))
    return AuthorsVocabulary(
        symbols=symbols,
        counts=counts,
        special=[_text(s) for s in fields.get("special") or []],
        lower_case=bool(fields.get("lower_case", True)),
        delimiter=delimiter if isinstance(delimiter, str) else None,
        unk=unk,
        dataset=_text(dataset) if isinstance(_text(dataset), str) else None,
    )


def write_authors_tokenizer(
    vocabulary: AuthorsVocabulary, dataset: str, output: str | Path, source: str | Path | None = None
) -> Tokenizer:
    """Write their vocabulary into the (existing, empty) folder ``output`` as a tokenizer of ``dataset``'s kind
    (see the module docstring); ids equal theirs. Returns the tokenizer, loaded back with every check."""
    output = Path(output)
    if dataset not in DATASETS:
        raise ValueError(f"dataset {dataset!r}: the authors' code knows {list(DATASETS)}")
    if vocabulary.delimiter not in (None,):
        raise ValueError(
            f"{source or 'the vocabulary'}: delimiter {vocabulary.delimiter!r}; the authors' released data split "
            f"on whitespace (delimiter None), which is all this conversion reads"
        )
    training = {"authors_vocabulary": str(source) if source is not None else None, "dataset": dataset}
    if source is not None:
        training["sha256"] = sha256_files([Path(source)])
    if dataset in WORD_DATASETS:
        return _write_words(vocabulary, dataset, output, training)
    if dataset == "enwik8":
        return _write_bytes(vocabulary, output, training)
    return _write_text8(vocabulary, output, training)


def _symbol_id(vocabulary: AuthorsVocabulary, symbol: str, dataset: str, why: str) -> int:
    try:
        return vocabulary.symbols.index(symbol)
    except ValueError:
        raise ValueError(f"the {dataset} vocabulary has no {symbol!r} ({why})") from None


def _write_words(vocabulary: AuthorsVocabulary, dataset: str, output: Path, training: dict) -> Tokenizer:
    spaced = next((s for s in vocabulary.symbols if any(c.isspace() for c in s)), None)
    if spaced is not None:
        raise ValueError(f"the {dataset} vocabulary holds {spaced!r}, a symbol with whitespace in it")
    if dataset == "lm1b":
        separator = "<S>"
        rules = ReadingRules(lower_case=vocabulary.lower_case, line_start=separator)
    else:
        separator = "<eos>"
        rules = ReadingRules(lower_case=vocabulary.lower_case)
    eos = _symbol_id(vocabulary, separator, dataset, "every line ends with it")
    unk = vocabulary.symbols.index(vocabulary.unk) if vocabulary.unk is not None else None
    write_word_vocab(output / WORD_VOCAB, vocabulary.symbols, vocabulary.counts)
    files = [WORD_VOCAB, *write_rules(output, rules)]
    pieces = {"eos": separator, "eod": separator, "unk": vocabulary.unk}
    return write_tokenizer_json(output, "word", files, len(vocabulary.symbols), eos, eos, unk, pieces, training)


def _write_bytes(vocabulary: AuthorsVocabulary, output: Path, training: dict) -> Tokenizer:
    values = []
    for index, symbol in enumerate(vocabulary.symbols):
        if not symbol.isdecimal() or not 0 <= int(symbol) <= 255 or symbol != str(int(symbol)):
            raise ValueError(f"the enwik8 vocabulary's symbol {index} is {symbol!r}, not a byte value in decimal")
        values.append(int(symbol))
    space = _symbol_id(vocabulary, "32", "enwik8", "the space byte ends each document")
    write_word_vocab(output / BYTE_VOCAB, [byte_piece(v) for v in values], vocabulary.counts)
    files = [BYTE_VOCAB, *write_rules(output, ReadingRules(line_breaks="dropped", ids="listed"))]
    pieces = {"eos": byte_piece(32), "eod": byte_piece(32)}
    return write_tokenizer_json(output, "byte", files, len(values), space, space, None, pieces, training)


def _write_text8(vocabulary: AuthorsVocabulary, output: Path, training: dict) -> Tokenizer:
    characters = []
    for index, symbol in enumerate(vocabulary.symbols):
        if len(symbol) != 1:
            raise ValueError(f"the text8 vocabulary's symbol {index} is {symbol!r}, not one character")
        characters.append(" " if symbol == "_" else symbol)  # their prep_text8.py writes the space as _
    if len(set(characters)) != len(characters) or "\n" in characters:
        raise ValueError("the text8 vocabulary holds both '_' and ' ', or a newline")
    space = _symbol_id(vocabulary, "_", "text8", "their symbol of the space, which ends each document")
    write_word_vocab(output / CHAR_VOCAB, [char_piece(c) for c in characters], vocabulary.counts)
    files = [CHAR_VOCAB, *write_rules(output, ReadingRules(line_breaks="dropped"))]
    pieces = {"eos": " ", "eod": " "}
    return write_tokenizer_json(output, "char", files, len(characters), space, space, None, pieces, training)
