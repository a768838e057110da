"""The vocabulary of the authors' released models (their cache.pkl) as txl_dist tokenizers: read without running
the pickle, refused in one line when it asks for anything but their classes and plain containers, and giving
their ids for any text, as their vocabulary.py reads it (tokenize + get_indices, per dataset)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from launchers import convert
from tests.authors_release import write_cache
from txl_dist.convert.authors_vocab import VocabularyPickleError, read_cache, write_authors_tokenizer
from txl_dist.tokenizer import TokenizerError, load_tokenizer

TEXT = ["The cat sat on the mat .", "", "  a Zebra <unk> IS here  ", "the end"]


def _their_ids(symbols: list[str], lines: list[str], dataset: str, lower_case: bool, unk: str | None) -> list[int]:
    """Their Vocab.tokenize (strip, lower-case, split, <eos> or <S>..<S>) and get_indices, per line."""
    index = {symbol: i for i, symbol in enumerate(symbols)}
    ids = []
    for line in lines:
        line = line.strip()
        line = line.lower() if lower_case else line
        words = line.split()
        words = ["<S>", *words, "<S>"] if dataset == "lm1b" else [*words, "<eos>"]
        ids += [index[w] if w in index else index[unk] for w in words]
    return ids


WORDS = ["the", "cat", "sat", "on", "mat", ".", "a", "is", "here", "end", "The", "IS"]
CASES = {
    "wt103": dict(symbols=["<eos>", *WORDS, "<unk>"], special=["<eos>"], lower_case=False, unk="<unk>"),
    "ptb": dict(symbols=["<eos>", *WORDS[:-2], "<unk>"], special=["<eos>"], lower_case=True, unk="<unk>"),
    "lm1b": dict(symbols=["<S>", "</S>", "<UNK>", *WORDS], special=[], lower_case=False, unk="<UNK>"),
}


@pytest.mark.parametrize("dataset", sorted(CASES))
def test_word_vocabularies_give_their_ids_for_any_text(dataset, tmp_path):
    case = CASES[dataset]
    unk_idx = case["symbols"].index(case["unk"]) if dataset == "lm1b" else None
    path = write_cache(
        tmp_path / "cache.pkl",
        dataset,
        case["symbols"],
        special=case["special"],
        lower_case=case["lower_case"],
        unk_idx=unk_idx,
    )
    (tmp_path / "tok").mkdir()
    tokenizer = write_authors_tokenizer(read_cache(path), dataset, tmp_path / "tok", path)
    assert load_tokenizer(tmp_path / "tok").fingerprint == tokenizer.fingerprint
    # Every line a document, blank ones too (WikiText's blank lines are <eos> in their data).
    tokens, _ = tokenizer.encode_documents([[line] for line in TEXT])
    assert tokens.tolist() == _their_ids(case["symbols"], TEXT, dataset, case["lower_case"], case["unk"])
    assert tokenizer.vocab_size == len(case["symbols"])
    assert tokenizer.id_to_piece(tokenizer.eod_id) == ("<S>" if dataset == "lm1b" else "<eos>")


def test_enwik8_bytes_and_text8_characters_give_their_ids(tmp_path):
    data = "Ünïcode <b>\nline two\n"
    symbols = [str(b) for b in sorted(set(data.encode("utf-8")) - {10})]
    path = write_cache(tmp_path / "enwik8.pkl", "enwik8", symbols, lower_case=True)
    (tmp_path / "enwik8").mkdir()
    tokenizer = write_authors_tokenizer(read_cache(path), "enwik8", tmp_path / "enwik8")
    # their prep_enwik8.py: each byte in decimal, the newline a line break that add_eos=False drops
    assert tokenizer.encode(data) == [symbols.index(str(b)) for b in data.encode("utf-8") if b != 10]
    with pytest.raises(ValueError, match=r"byte <0x7A> is not in the vocabulary of .*bytes.txt"):
        tokenizer.encode("z")
    text8 = ["_", "e", "t", "a", "h"]
    path = write_cache(tmp_path / "text8.pkl", "text8", text8, lower_case=True)
    (tmp_path / "text8").mkdir()
    tokenizer = write_authors_tokenizer(read_cache(path), "text8", tmp_path / "text8")
    assert tokenizer.encode("the tea") == [text8.index(c) for c in "the_tea"]  # their prep_text8.py: ' ' -> '_'
    assert tokenizer.decode(tokenizer.encode("the tea")) == "the tea"


def test_a_python2_style_protocol_0_pickle_is_read_too(tmp_path):
    path = write_cache(tmp_path / "cache.pkl", "wt103", CASES["wt103"]["symbols"], special=["<eos>"], protocol=0)
    assert read_cache(path).symbols == CASES["wt103"]["symbols"]


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["os.system", "torch.nn.Linear", "builtins.eval"])
def test_a_cache_asking_for_any_other_global_is_refused_and_nothing_runs(payload, tmp_path, capsys):
    marker = tmp_path / "ran"
    extra = {
        "os.system": _RunsCode(marker),
        "torch.nn.Linear": torch.nn.Linear(2, 2),
        "builtins.eval": _Eval(marker),
    }[payload]
    symbols = CASES["wt103"]["symbols"]
    path = write_cache(tmp_path / "cache.pkl", "wt103", symbols, special=["<eos>"], extra=extra)
    with pytest.raises(VocabularyPickleError, match="refused: the pickle asks for") as error:
        read_cache(path)
    assert not marker.exists()
    named = {"os.system": "system", "torch.nn.Linear": "torch", "builtins.eval": "builtins.eval"}[payload]
    assert named in str(error.value) and "\n" not in str(error.value)
    # Through the command line: one line, exit status 2, nothing written, before TensorFlow is needed.
    release = tmp_path / "release"
    (release / "model").mkdir(parents=True)
    (release / "data").mkdir()
    (release / "model" / "model.ckpt-0.index").write_bytes(b"")
    (release / "model" / "model.ckpt-0.data-00000-of-00001").write_bytes(b"")
    (release / "data" / "cache.pkl").write_bytes(path.read_bytes())
    (release / "data" / "corpus-info.json").write_text(json.dumps({"vocab_size": len(symbols), "cutoffs": []}))
    assert convert.main(["tf-to-export", str(release), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused" in err and named in err
    assert not (tmp_path / "out").exists() and not marker.exists()


class _Eval:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w')",))


@pytest.mark.parametrize(
    "damage", [lambda b: b[: len(b) // 2], lambda b: b"not a pickle at all", lambda b: pickle.dumps([1, 2, 3])]
)
def test_a_damaged_or_foreign_cache_is_one_line(damage, tmp_path):
    path = write_cache(tmp_path / "cache.pkl", "wt103", CASES["wt103"]["symbols"], special=["<eos>"])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(VocabularyPickleError) as error:
        read_cache(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_rules_are_part_of_the_fingerprint_and_checked(tmp_path):
    path = write_cache(tmp_path / "cache.pkl", "ptb", CASES["ptb"]["symbols"], special=["<eos>"], lower_case=True)
    (tmp_path / "tok").mkdir()
    tokenizer = write_authors_tokenizer(read_cache(path), "ptb", tmp_path / "tok")
    assert tokenizer.files == ["vocab.txt", "rules.json"] and tokenizer.rules.lower_case
    rules = tmp_path / "tok" / "rules.json"
    rules.write_text(json.dumps({"lower_case": False}))
    with pytest.raises(TokenizerError, match="sha256 is .* records fingerprint"):
        load_tokenizer(tmp_path / "tok")
    for bad, message in (
        ({"lower_case": "yes"}, "key 'lower_case' must be true or false"),
        ({"line_breaks": "dropped"}, "key 'line_breaks' is no rule of a word tokenizer"),
        ({"line_start": "<nope>"}, "'line_start' '<nope>' is not in"),
    ):
        rules.write_text(json.dumps(bad))
        description = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
        from txl_dist.tokenizer import fingerprint_files

        description["fingerprint"] = fingerprint_files(tmp_path / "tok", description["files"])
        (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(description))
        with pytest.raises(TokenizerError, match=message):
            load_tokenizer(tmp_path / "tok")
