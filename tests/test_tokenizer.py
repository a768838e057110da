"""txl_dist.tokenizer and data_tools.train_tokenizer: both kinds on the Penn Treebank, the lm1b preset, and the
clear errors of a damaged tokenizer directory."""

from __future__ import annotations

import collections
import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import treebank

from data_tools import train_tokenizer
from data_tools.corpora import published
from data_tools.vocabularies.sentencepiece import sample_lines, training_pieces
from tests.conftest import ptb_sentences
from txl_dist.data.format import TokenizerIdentity
from txl_dist.tokenizer import TokenizerError, find_tokenizer_dir, load_tokenizer, verified_fingerprint


def test_ptb_word_vocabulary_is_the_standard_10000_words(ptb_word_tokenizer):
    tokenizer = load_tokenizer(ptb_word_tokenizer)
    counts = collections.Counter(treebank.penn["train"].split())
    assert len(counts) == 9999
    assert tokenizer.kind == "word"
    assert tokenizer.vocab_size == 10000
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    assert pieces[0] == "<eos>" and tokenizer.eos_id == tokenizer.eod_id == 0
    assert set(pieces[1:]) == set(counts)
    # <unk> is a word of the PTB text: it keeps its place by frequency instead of becoming a special.
    assert tokenizer.id_to_piece(tokenizer.unk_id) == "<unk>"
    assert [counts[piece] for piece in pieces[1:]] == sorted(counts.values(), reverse=True)
    assert tokenizer.fingerprint == hashlib.sha256((ptb_word_tokenizer / "vocab.txt").read_bytes()).hexdigest()
    assert TokenizerIdentity(**tokenizer.identity()).vocab_size == 10000


def test_word_encode_decode_and_documents(ptb_word_tokenizer):
    tokenizer = load_tokenizer(ptb_word_tokenizer)
    sentence = ptb_sentences("valid")[0]
    ids = tokenizer.encode(sentence)
    assert [tokenizer.id_to_piece(i) for i in ids] == sentence.split()
    assert tokenizer.decode(ids) == " ".join(sentence.split())
    assert tokenizer.encode("the zyzzyva") == [tokenizer.encode("the")[0], tokenizer.unk_id]
    document = "the market fell\n\nit rose"
    expected = tokenizer.encode("the market fell") + [0] + [0] + tokenizer.encode("it rose") + [0]
    assert tokenizer.encode_document(document) == expected
    assert tokenizer.decode_document(expected) == document
    with pytest.raises(ValueError, match="10000"):
        tokenizer.id_to_piece(10000)


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_word_min_count_max_size_and_specials(tmp_path):
    text = _write_lines(tmp_path / "text.txt", ["a a a b b c", "d a b e e", "  ", "c e"])
    counts = collections.Counter(text.read_text().split())  # a4 b3 e3 c2 d1
    output = tmp_path / "tok"
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "word",
                "--input",
                str(text),
                "--output",
                str(output),
                "--min-count",
                "2",
                "--specials",
                "<eos>",
                "<pad>",
                "--eod",
                "<eod>",
                "--no-progress",
            ]
        )
        == 0
    )
    tokenizer = load_tokenizer(output)
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    kept = sorted((w for w, c in counts.items() if c >= 2), key=lambda w: (-counts[w], w))
    assert pieces == ["<eos>", "<pad>", "<eod>", "<unk>"] + kept
    assert (tokenizer.eos_id, tokenizer.eod_id, tokenizer.unk_id) == (0, 2, 3)
    assert tokenizer.encode("d a") == [3, pieces.index("a")]
    assert tokenizer.encode_document("a\nb") == [pieces.index("a"), 0, pieces.index("b"), 2]

    capped = tmp_path / "capped"
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--input", str(text), "--output", str(capped), "--max-size", "4", "--no-progress"]
        )
        == 0
    )
    assert [load_tokenizer(capped).id_to_piece(i) for i in range(4)] == ["<eos>", "<unk>", "a", "b"]


def test_lm1b_preset_counts_training_words_seen_three_times(fabricated_lm1b_dir, tmp_path):
    output = tmp_path / "tok"
    assert (
        train_tokenizer.main(
            [
                "--preset",
                "lm1b",
                "--format",
                "lm1b",
                "--input",
                str(fabricated_lm1b_dir),
                "--output",
                str(output),
                "--no-progress",
            ]
        )
        == 0
    )
    counts = collections.Counter()
    for name in published.LM1B_TRAIN_FILES:  # the training files only, never the heldout ones
        counts.update((fabricated_lm1b_dir / published.LM1B_TRAIN_DIR / name).read_text().split())
    words = sorted((w for w, c in counts.items() if c >= 3), key=lambda w: (-counts[w], w))
    tokenizer = load_tokenizer(output)
    assert [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)] == ["<S>", "</S>", "<UNK>"] + words
    assert (tokenizer.id_to_piece(tokenizer.eos_id), tokenizer.id_to_piece(tokenizer.unk_id)) == ("</S>", "<UNK>")
    assert tokenizer.eod_id == tokenizer.eos_id
    settings = json.loads((output / "tokenizer.json").read_text())["training"]
    assert settings["min_count"] == 3 and len(settings["inputs"]) == 99


def test_sentencepiece_round_trip_and_end_of_document(ptb_sentencepiece_tokenizer):
    tokenizer = load_tokenizer(ptb_sentencepiece_tokenizer)
    assert tokenizer.kind == "sentencepiece" and tokenizer.vocab_size == 2000
    assert tokenizer.id_to_piece(tokenizer.eos_id) == "</s>"
    assert tokenizer.id_to_piece(tokenizer.eod_id) == "<eod>" and tokenizer.eod_id != tokenizer.eos_id
    assert tokenizer.fingerprint == hashlib.sha256((ptb_sentencepiece_tokenizer / "spm.model").read_bytes()).hexdigest()
    sentences = [s for s in ptb_sentences("valid")[:300] if "<unk>" not in s]
    for sentence in sentences:
        assert tokenizer.decode(tokenizer.encode(sentence)) == " ".join(sentence.split())
    tokens, per_document = tokenizer.encode_documents([[sentences[0]], [sentences[1], sentences[2]]])
    first, second, third = (tokenizer.encode(s) for s in sentences[:3])
    assert tokens.tolist() == first + [tokenizer.eod_id] + second + [tokenizer.eos_id] + third + [tokenizer.eod_id]
    assert per_document.tolist() == [len(first) + 1, len(second) + len(third) + 2]
    assert tokenizer.decode_document(tokens[per_document[0] :].tolist()) == "\n".join(
        " ".join(s.split()) for s in sentences[1:3]
    )


def test_sentence_sample_is_uniform_bounded_and_seeded():
    batches = [[f"line {i}" for i in range(start, start + 100)] for start in range(0, 1000, 100)]
    sample = sample_lines(batches, 50, seed=3)
    assert len(sample) == len(set(sample)) == 50 and set(sample) <= {f"line {i}" for i in range(1000)}
    assert sample == sample_lines(batches, 50, seed=3)
    assert sample != sample_lines(batches, 50, seed=4)
    assert sample_lines(batches[:1], 500, seed=3) == batches[0]
    # Uniform: over many seeds, lines of the first and of the last batch are drawn about equally often.
    draws = collections.Counter(
        int(line.split()[1]) // 500 for seed in range(200) for line in sample_lines(batches, 50, seed)
    )
    assert abs(draws[0] - draws[1]) < 0.1 * (draws[0] + draws[1])


def test_sentencepiece_unigram_sampled_training_is_reproducible(ptb_text_dir, tmp_path):
    fingerprints = []
    for run in ("a", "b"):
        output = tmp_path / run
        assert (
            train_tokenizer.main(
                [
                    "--kind",
                    "sentencepiece",
                    "--model-type",
                    "unigram",
                    "--vocab-size",
                    "800",
                    "--input-sentence-size",
                    "1500",
                    "--input",
                    str(ptb_text_dir / "ptb.valid.txt"),
                    "--output",
                    str(output),
                    "--no-progress",
                ]
            )
            == 0
        )
        tokenizer = load_tokenizer(output)
        assert tokenizer.vocab_size == 800 and tokenizer.eod_id == tokenizer.eos_id
        fingerprints.append(tokenizer.fingerprint)
        training = json.loads((output / "tokenizer.json").read_text())["training"]
        assert training["model_type"] == "unigram" and training["sampled_lines"] == 1500
    assert fingerprints[0] == fingerprints[1]


def test_train_tokenizer_refuses_a_non_empty_output_and_bad_flags(ptb_text_dir, tmp_path, capsys):
    output = tmp_path / "tok"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    argv = ["--kind", "word", "--input", str(ptb_text_dir / "ptb.valid.txt"), "--output", str(output), "--no-progress"]
    assert train_tokenizer.main(argv) == 2
    assert f"{output}: not empty" in capsys.readouterr().err
    assert train_tokenizer.main(argv + ["--overwrite", "--eos", "<nope>"]) == 2
    assert "--eos '<nope>' is not one of --specials" in capsys.readouterr().err
    missing = tmp_path / "missing.txt"
    assert train_tokenizer.main(["--kind", "word", "--input", str(missing), "--output", str(tmp_path / "t2")]) == 2
    assert f"{missing}: no such input file" in capsys.readouterr().err


@pytest.fixture
def word_tokenizer_copy(ptb_word_tokenizer, tmp_path) -> Path:
    copy = tmp_path / "tok"
    shutil.copytree(ptb_word_tokenizer, copy)
    return copy


def test_missing_tokenizer_json_is_named(word_tokenizer_copy):
    (word_tokenizer_copy / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=f"{word_tokenizer_copy / 'tokenizer.json'}: missing"):
        load_tokenizer(word_tokenizer_copy)
    with pytest.raises(TokenizerError, match="no such tokenizer directory"):
        load_tokenizer(word_tokenizer_copy / "nowhere")


def test_corrupt_tokenizer_json_is_named(word_tokenizer_copy):
    path = word_tokenizer_copy / "tokenizer.json"
    path.write_text(path.read_text()[:-20])
    with pytest.raises(TokenizerError, match=f"{path}: not valid JSON"):
        load_tokenizer(word_tokenizer_copy)


def test_missing_or_changed_vocabulary_is_named(word_tokenizer_copy):
    vocab = word_tokenizer_copy / "vocab.txt"
    vocab.write_text(vocab.read_text() + "extra\t1\n")
    with pytest.raises(TokenizerError, match=f"{vocab}: sha256 is .* the file changed after training"):
        load_tokenizer(word_tokenizer_copy)
    vocab.unlink()
    with pytest.raises(TokenizerError, match=f"{vocab}: missing tokenizer file"):
        load_tokenizer(word_tokenizer_copy)


def _refingerprint(directory: Path, name: str) -> None:
    """Make tokenizer.json agree with a damaged file, so that the load gets past the fingerprint check."""
    path = directory / "tokenizer.json"
    description = json.loads(path.read_text())
    description["fingerprint"] = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(description))


def test_corrupt_vocabulary_and_model_files_are_named(word_tokenizer_copy, ptb_sentencepiece_tokenizer, tmp_path):
    vocab = word_tokenizer_copy / "vocab.txt"
    lines = vocab.read_text().split("\n")
    vocab.write_text("\n".join(lines[:5] + [lines[3]] + lines[6:]))
    _refingerprint(word_tokenizer_copy, "vocab.txt")
    with pytest.raises(TokenizerError, match=f"{vocab}, line 6: token 'N' appears twice"):
        load_tokenizer(word_tokenizer_copy)

    sentencepiece_copy = tmp_path / "sp"
    shutil.copytree(ptb_sentencepiece_tokenizer, sentencepiece_copy)
    model = sentencepiece_copy / "spm.model"
    model.write_bytes(b"\x00garbage" + model.read_bytes()[:100])
    _refingerprint(sentencepiece_copy, "spm.model")
    with pytest.raises(TokenizerError, match=f"{model}: not a valid SentencePiece model"):
        load_tokenizer(sentencepiece_copy)


def test_description_disagreeing_with_the_files_is_named(word_tokenizer_copy):
    path = word_tokenizer_copy / "tokenizer.json"
    description = json.loads(path.read_text())
    path.write_text(json.dumps({**description, "vocab_size": 9999}))
    with pytest.raises(TokenizerError, match="key 'vocab_size' is 9999, but .*vocab.txt has 10000 entries"):
        load_tokenizer(word_tokenizer_copy)
    path.write_text(json.dumps({**description, "eos_id": 5}))
    with pytest.raises(TokenizerError, match="'eos_id' 5 is 'to' in .*vocab.txt, but key 'pieces.eos' says '<eos>'"):
        load_tokenizer(word_tokenizer_copy)


def test_verified_fingerprint_checks_the_files_but_does_not_read_the_vocabulary(word_tokenizer_copy):
    """What training compares with the shards: the loaded tokenizer's fingerprint, refused for a changed or
    missing file as `load_tokenizer` refuses it, without building the vocabulary (a description that disagrees
    with the vocabulary's contents is `load_tokenizer`'s to find)."""
    assert verified_fingerprint(word_tokenizer_copy) == load_tokenizer(word_tokenizer_copy).fingerprint
    path = word_tokenizer_copy / "tokenizer.json"
    description = json.loads(path.read_text())
    path.write_text(json.dumps({**description, "vocab_size": 9999}))
    assert verified_fingerprint(word_tokenizer_copy) == description["fingerprint"]
    vocab = word_tokenizer_copy / "vocab.txt"
    vocab.write_text(vocab.read_text() + "extra\t1\n")
    with pytest.raises(TokenizerError, match=f"{vocab}: sha256 is .* the file changed after training"):
        verified_fingerprint(word_tokenizer_copy)
    vocab.unlink()
    with pytest.raises(TokenizerError, match=f"{vocab}: missing tokenizer file"):
        verified_fingerprint(word_tokenizer_copy)


def test_find_tokenizer_dir_by_fingerprint(ptb_word_tokenizer, ptb_sentencepiece_tokenizer, tmp_path):
    wanted = load_tokenizer(ptb_sentencepiece_tokenizer).fingerprint
    candidates = [None, tmp_path / "missing", ptb_word_tokenizer, ptb_sentencepiece_tokenizer]
    assert find_tokenizer_dir(wanted, candidates) == ptb_sentencepiece_tokenizer
    with pytest.raises(TokenizerError, match=f"{ptb_word_tokenizer}: fingerprint .*, not the wanted {wanted}"):
        find_tokenizer_dir(wanted, [ptb_word_tokenizer], strict=True)
    with pytest.raises(TokenizerError, match=f"no tokenizer with fingerprint {wanted} .*missing: no such tokenizer"):
        find_tokenizer_dir(wanted, candidates[:3])


def _expected_vocabulary(paths: list[Path], min_count: int, specials: list[str]) -> list[str]:
    """The word vocabulary counted with str.split() over the decoded files, without the code under test."""
    counts = collections.Counter()
    for path in paths:
        counts.update(path.read_bytes().decode("utf-8", "replace").split())
    return specials + sorted(
        (w for w, c in counts.items() if c >= min_count and w not in specials), key=lambda w: (-counts[w], w)
    )


def test_word_vocabulary_is_the_same_for_any_worker_count(tmp_path):
    from benchmarks.corpora import synthetic_lm1b

    synthetic_lm1b.write_corpus(tmp_path / "corpus", synthetic_lm1b.CorpusShape(scale=0.0003, seed=1), progress=False)
    root = tmp_path / "corpus" / synthetic_lm1b.ROOT_NAME / published.LM1B_TRAIN_DIR
    inputs = sorted(root.iterdir())[:20]
    # Text the numpy path leaves to str.split(): no-break spaces, U+3000, CRLF, a NUL, bytes that are not UTF-8,
    # and a line of nothing but whitespace; and words longer than 8 bytes.
    tricky = tmp_path / "tricky.txt"
    tricky.write_bytes(
        "b\xa0ci da\u3000f  go\r\nbure\x00cem ci\n \t \nlongerthaneightbytes ci ci\n".encode()
        + b"da \xff\xfe da \xff\xfe\n"
        + "é longerthaneightbytes\n".encode() * 3
    )
    inputs.append(tricky)
    long_words = tmp_path / "long_words.txt"  # clean text: the numpy path, with words of more than 8 bytes
    long_words.write_text("ninebytes tenbytes10 ci\n" * 3 + "eightbyt ninebytes\n", encoding="utf-8")
    inputs.append(long_words)
    runs = {}
    for workers in (1, 2, 3):
        output = tmp_path / f"workers{workers}"
        assert (
            train_tokenizer.main(
                [
                    "--kind",
                    "word",
                    "--input",
                    *map(str, inputs),
                    "--output",
                    str(output),
                    "--min-count",
                    "2",
                    "--specials",
                    "<eos>",
                    "--workers",
                    str(workers),
                    "--no-progress",
                ]
            )
            == 0
        )
        runs[workers] = {name: (output / name).read_bytes() for name in ("vocab.txt", "tokenizer.json")}
    assert runs[1] == runs[2] == runs[3]
    tokenizer = load_tokenizer(tmp_path / "workers2")
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    expected = _expected_vocabulary(inputs, 2, ["<eos>", "<unk>"])
    assert len(pieces) > 1000 and pieces == expected
    assert {"ci", "da", "é", "longerthaneightbytes", "\ufffd\ufffd", "ninebytes", "tenbytes10"} <= set(pieces)
    assert tokenizer.counts[pieces.index("ninebytes")] == 4
    statistics = json.loads(runs[2]["tokenizer.json"])["training"]["statistics"]
    lines = [line for path in inputs for line in path.read_bytes().decode("utf-8", "replace").split("\n")[:-1]]
    assert statistics["documents"] == sum(1 for line in lines if line.split())
    assert statistics["empty_documents"] == 1 and statistics["replaced_bytes"] == 4


def _speeches(count: int, seed: int) -> list[str]:
    """Documents of one line of about 50 KB each: sentences of made-up words, one word ('qzxv') only in the
    second half of each, beyond the first 4,192 bytes."""
    generator = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    documents = []
    for _ in range(count):
        sentences = []
        while sum(map(len, sentences)) < 50_000:
            length = generator.randint(6, 30)
            late = sum(map(len, sentences)) > 25_000
            sentence = [generator.choice(words + ["qzxv"] * 3 if late else words) for _ in range(length)]
            sentences.append(" ".join(sentence).capitalize() + generator.choice([".", "!", "?", "."]))
        documents.append(" ".join(sentences))
    return documents


@pytest.mark.parametrize("doc_per", ["line", "file"])
def test_sentencepiece_trains_on_documents_longer_than_its_sentence_limit(doc_per, tmp_path):
    documents = _speeches(12, seed=4)
    assert min(len(d.encode()) for d in documents) > 50_000
    if doc_per == "line":
        inputs = [_write_lines(tmp_path / "speeches.txt", documents)]
    else:
        inputs = [_write_lines(tmp_path / f"speech{i}.txt", [d]) for i, d in enumerate(documents)]
    output = tmp_path / "tok"
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "sentencepiece",
                "--model-type",
                "unigram",
                "--vocab-size",
                "60",
                "--character-coverage",
                "1.0",
                "--input",
                *map(str, inputs),
                "--doc-per",
                doc_per,
                "--input-sentence-size",
                "100000",
                "--output",
                str(output),
                "--no-progress",
            ]
        )
        == 0
    )
    tokenizer = load_tokenizer(output)
    training = json.loads((output / "tokenizer.json").read_text())["training"]
    assert training["lines_cut"] == 12 and training["max_sentence_length"] == 4192
    # Every document was trained on: its sentences (about 450 of them each) went to SentencePiece whole, the word
    # of the second halves became one piece, and the text round-trips.
    assert training["sampled_lines"] == sum(d.count(". ") + d.count("! ") + d.count("? ") + 1 for d in documents)
    assert "▁qzxv" in [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    assert tokenizer.decode(tokenizer.encode(documents[0][:3000])) == documents[0][:3000]


def test_training_pieces_cut_long_lines_at_sentence_ends_then_whitespace():
    sentences = ["First one here.", "A “quoted” end.”", "Why?", "Short!"]
    line = " ".join(sentences * 200)
    pieces = training_pieces(line, 120)
    assert pieces == sentences * 200
    no_ends = " ".join(["wordy"] * 100)
    pieces = training_pieces(no_ends, 40)
    assert all(len(p) <= 40 for p in pieces) and " ".join(pieces) == no_ends and len(pieces[0]) > 30
    assert training_pieces("é" * 30 + " x", 16) == ["é" * 8, "é" * 8, "é" * 8, "é" * 6, "x"]
    short = "short line. stays whole."
    assert training_pieces(short, 4192)[0] is short


def test_sentencepiece_sample_stays_bounded_and_empty_input_is_one_error(tmp_path, capsys):
    documents = _speeches(4, seed=5)
    text = _write_lines(tmp_path / "speeches.txt", documents)
    output = tmp_path / "tok"
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "sentencepiece",
                "--vocab-size",
                "40",
                "--character-coverage",
                "1.0",
                "--input",
                str(text),
                "--input-sentence-size",
                "300",
                "--output",
                str(output),
                "--no-progress",
            ]
        )
        == 0
    )
    assert json.loads((output / "tokenizer.json").read_text())["training"]["sampled_lines"] == 300
    blank = _write_lines(tmp_path / "blank.txt", ["   ", "\t", ""])
    assert (
        train_tokenizer.main(
            ["--kind", "sentencepiece", "--input", str(blank), "--output", str(tmp_path / "none"), "--no-progress"]
        )
        == 2
    )
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "no document in the input" in error[0] and "blank.txt" in error[0]
