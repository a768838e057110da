"""data_tools.build_shards: the Penn Treebank through the whole path, determinism over worker counts, document
units and input kinds, the One Billion Word layout, the holdout split, bad input, and resume."""

from __future__ import annotations

import collections
import gzip
import hashlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from data_tools import build_shards, inspect_shards
from data_tools.corpora import chunking, published, text_decoding
from data_tools.corpora.inputs import input_files
from data_tools.errors import InputError
from data_tools.workers import WorkerError, ordered_map
from tests.conftest import PTB_TOKENS_PER_BLOCK, PTB_TOKENS_PER_SHARD, ptb_sentences
from txl_dist.data.format import MANIFEST_NAME, read_manifest
from txl_dist.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def read_split(directory: Path, split: str) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(token stream, each block's tokens, each block's doc_offsets) of a split, read with webdataset."""
    manifest = read_manifest(directory)
    urls = [str(directory / shard.path) for shard in manifest.splits[split].shards]
    blocks, offsets = [], []
    for sample in wds.WebDataset(urls, shardshuffle=False):
        blocks.append(np.load(io.BytesIO(sample["tokens.npy"])))
        offsets.append(np.load(io.BytesIO(sample["doc_offsets.npy"])))
    return np.concatenate(blocks), blocks, offsets


def word_ids(tokenizer_directory: Path) -> dict[str, int]:
    """The word vocabulary, read from vocab.txt without the code under test."""
    lines = (tokenizer_directory / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    return {line.split("\t")[0]: i for i, line in enumerate(lines)}


def run_build(*args: str | Path) -> int:
    return build_shards.main([str(a) for a in args] + ["--no-progress"])


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_ptb_word_shards_hold_the_exact_token_stream(ptb_word_shards, ptb_word_tokenizer):
    ids = word_ids(ptb_word_tokenizer)
    eos = ids["<eos>"]
    manifest = read_manifest(ptb_word_shards)
    assert sorted(manifest.splits) == ["test", "train", "valid"]
    assert manifest.tokenizer.fingerprint == load_tokenizer(ptb_word_tokenizer).fingerprint
    assert (manifest.dtype, manifest.block_tokens, manifest.tokenizer.eod_id) == ("uint16", PTB_TOKENS_PER_BLOCK, eos)
    for split, entry in manifest.splits.items():
        sentences = ptb_sentences(split)
        expected = [i for sentence in sentences for i in [ids[w] for w in sentence.split()] + [eos]]
        stream, blocks, offsets = read_split(ptb_word_shards, split)
        assert stream.tolist() == expected
        assert (entry.documents, entry.tokens) == (len(sentences), len(expected))
        assert entry.words == sum(len(s.split()) + 1 for s in sentences)
        assert entry.characters == sum(len(s) + 1 for s in sentences)
        # Sentences are far shorter than a block: every block holds whole sentences.
        for tokens, doc_offsets in zip(blocks, offsets):
            assert len(tokens) <= PTB_TOKENS_PER_BLOCK and doc_offsets[0] == 0 and tokens[-1] == eos
            assert all(tokens[o - 1] == eos for o in doc_offsets[1:])
        assert sum(len(o) for o in offsets) == len(sentences)
        assert all(shard.tokens >= PTB_TOKENS_PER_SHARD for shard in entry.shards[:-1])
    lines = treebank_lines("train")
    assert manifest.build["statistics"]["train"]["empty_documents"] == sum(not line.strip() for line in lines) == 1


def test_ptb_files_give_the_shards_of_the_treebank_package(ptb_word_shards, ptb_word_tokenizer, ptb_text_dir, tmp_path):
    output = tmp_path / "from_files"
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            output,
            "--format",
            "ptb",
            "--input",
            ptb_text_dir,
            "--tokens-per-block",
            PTB_TOKENS_PER_BLOCK,
            "--tokens-per-shard",
            PTB_TOKENS_PER_SHARD,
        )
        == 0
    )
    from_files, from_package = files_of(output), files_of(ptb_word_shards)
    assert from_files.pop(MANIFEST_NAME) != from_package.pop(MANIFEST_NAME)  # the input names differ
    assert from_files == from_package


def treebank_lines(split: str) -> list[str]:
    import treebank

    return treebank.penn[split].split("\n")[:-1]


def test_ptb_sentencepiece_shards_end_each_sentence_with_eod(ptb_sentencepiece_tokenizer, tmp_path, capsys):
    tokenizer = load_tokenizer(ptb_sentencepiece_tokenizer)
    output = tmp_path / "shards"
    assert (
        run_build(
            "--tokenizer",
            ptb_sentencepiece_tokenizer,
            "--output",
            output,
            "--format",
            "ptb",
            "--tokens-per-block",
            8192,
            "--tokens-per-shard",
            200000,
        )
        == 0
    )
    assert re.search(
        r"build_shards: 49,199 documents, [\d,]+ tokens, 1 empty documents skipped", capsys.readouterr().out
    )
    manifest = read_manifest(output)
    assert manifest.tokenizer.eod_id == tokenizer.eod_id != tokenizer.eos_id
    for split in ("train", "valid", "test"):
        sentences = ptb_sentences(split)
        expected = [i for sentence in sentences for i in tokenizer.encode(sentence) + [tokenizer.eod_id]]
        assert read_split(output, split)[0].tolist() == expected
        assert manifest.splits[split].documents == len(sentences)
    assert inspect_shards.main([str(output), "--verify", "--no-progress"]) == 0


def test_worker_count_does_not_change_a_byte(ptb_sentencepiece_tokenizer, ptb_text_dir, tmp_path):
    args = [
        "--tokenizer",
        ptb_sentencepiece_tokenizer,
        "--split",
        f"train={ptb_text_dir / 'ptb.train.txt'}",
        "--split",
        f"test={ptb_text_dir / 'ptb.test.txt'}",
        "--holdout",
        "valid=0.05",
        "--chunk-bytes",
        65536,
        "--tokens-per-block",
        1000,
        "--tokens-per-shard",
        50000,
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_build(*args, "--output", one, "--workers", 1) == 0
    # The real command line, as users run it.
    completed = subprocess.run(
        [sys.executable, "-m", "data_tools.build_shards", *map(str, args), "--output", str(two), "--workers", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    assert (
        "build_shards: " in completed.stdout and "B/s" in completed.stderr
    )  # summary line, progress bar (kB/s or MB/s)
    assert len(read_manifest(one).splits["train"].shards) > 10
    assert files_of(one) == files_of(two)


def test_worker_processes_return_results_in_order_and_report_errors_and_deaths():
    # Builtins as the work: spawned workers find them without importing any test module.
    tasks = [-5, 3, -1, 8, -13, 2, -7]
    assert list(ordered_map(abs, tasks, workers=3, initializer=int)) == [abs(t) for t in tasks]
    # The caller works too: a task that finds the spawned workers busy is computed here, in order all the same.
    from tests.worker_tasks import slow_pid

    results = list(ordered_map(slow_pid, range(40), workers=3, initializer=int, in_flight_per_worker=2))
    assert [task for task, _ in results] == list(range(40))
    processes = collections.Counter(pid for _, pid in results)
    assert len(processes) == 3 and processes[os.getpid()] > 0
    results = ordered_map(int, ["1", "2", "x", "4"], workers=2, initializer=int, in_flight_per_worker=2)
    assert next(results) == 1 and next(results) == 2
    with pytest.raises(ValueError, match="invalid literal for int"):
        next(results)  # "x" was computed here (the one spawned worker held "1" and "2"); raised in its turn
    # A task goes to an idle spawned worker first: this one dies, and says so.
    with pytest.raises(WorkerError, match=r"died without a result \(exit code 3\)"):
        list(ordered_map(os._exit, [3], workers=2, initializer=int))


def test_tokenising_workers_import_neither_torch_nor_webdataset():
    # Each spawned worker imports data_tools.build_shards; torch in there costs every worker about a second of
    # CPU and 300 MB, which once made 2 workers no faster than 1 on a 2-core machine.
    probe = (
        "import sys, data_tools.build_shards, txl_dist.data.format, txl_dist.tokenizer; "
        "print(sorted(m for m in ('torch', 'webdataset', 'deepspeed') if m in sys.modules))"
    )
    completed = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]", completed.stdout


def test_long_document_spans_blocks_with_its_boundaries_kept(ptb_word_tokenizer, tmp_path):
    tokenizer = load_tokenizer(ptb_word_tokenizer)
    sentences = ptb_sentences("valid")
    paragraphs = [sentences[0:2], sentences[2:3], sentences[3:20], sentences[20:22], sentences[22:23]]
    text = tmp_path / "paragraphs.txt"
    text.write_text("\n\n \n".join("\n".join(p) for p in paragraphs) + "\n", encoding="utf-8")
    output = tmp_path / "shards"
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            output,
            "--split",
            f"train={text}",
            "--doc-per",
            "blank-line",
            "--tokens-per-block",
            64,
            "--tokens-per-shard",
            128,
        )
        == 0
    )
    expected, lengths = tokenizer.encode_documents(paragraphs)
    assert lengths[2] > 3 * 64 and all(lengths[i] <= 64 for i in (0, 1, 3, 4))
    stream, blocks, offsets = read_split(output, "train")
    assert stream.tolist() == expected.tolist()
    block_starts = np.cumsum([0] + [len(b) for b in blocks])
    document_starts = np.concatenate([start + o for start, o in zip(block_starts, offsets)])
    assert document_starts.tolist() == np.cumsum([0, *lengths[:-1]]).tolist()
    assert all(len(block) <= 64 for block in blocks)
    # A document that fits in a block is never cut; the long one starts a block, fills whole blocks (with no
    # document beginning in them) and its tail shares the last of them with the next document.
    for start, length in zip(document_starts, lengths):
        first, last = (np.searchsorted(block_starts, p, side="right") - 1 for p in (start, start + length - 1))
        assert first == last if length <= 64 else block_starts[first] == start
    long_first = np.searchsorted(block_starts, document_starts[2])
    assert [len(o) for o in offsets[long_first + 1 : long_first + 3]] == [0, 0]
    assert read_manifest(output).splits["train"].documents == 5


def test_manifest_counts_equal_a_direct_count(ptb_word_tokenizer, tmp_path):
    sentences = ptb_sentences("test")
    documents = [sentences[i : i + 1 + i % 4] for i in range(0, 400, 5)]  # 80 documents of 1-4 lines
    plain = tmp_path / "a.txt"
    plain.write_text("\n\n".join("\n".join(d) for d in documents[:40]) + "\n", encoding="utf-8")
    packed = tmp_path / "b.txt.gz"
    packed.write_bytes(gzip.compress(("\n\n".join("\n".join(d) for d in documents[40:]) + "\n").encode()))
    records = tmp_path / "c.jsonl"
    records.write_text("".join(json.dumps({"id": i, "body": "\n".join(d)}) + "\n" for i, d in enumerate(documents)))

    def direct(docs: list[list[str]]) -> dict[str, int]:
        return {
            "documents": len(docs),
            "tokens": sum(len(" ".join(d).split()) + len(d) for d in docs),
            "words": sum(len(" ".join(d).split()) + 1 for d in docs),
            "characters": sum(len("\n".join(d)) + 1 for d in docs),
        }

    cases = {
        "blank-line": ([plain, packed], documents),
        "line": ([plain, packed], [[line] for d in documents for line in d]),
        "file": (
            [plain, packed],
            [
                [line for d in documents[:40] for line in d + [""]][:-1],
                [line for d in documents[40:] for line in d + [""]][:-1],
            ],
        ),
    }
    for unit, (inputs, docs) in cases.items():
        output = tmp_path / unit
        assert (
            run_build(
                "--tokenizer",
                ptb_word_tokenizer,
                "--output",
                output,
                "--doc-per",
                unit,
                "--split",
                "train=" + ",".join(map(str, inputs)),
            )
            == 0
        )
        split = read_manifest(output).splits["train"]
        assert {key: getattr(split, key) for key in direct(docs)} == direct(docs), unit
    output = tmp_path / "jsonl"
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            output,
            "--split",
            f"train={records}",
            "--jsonl-field",
            "body",
        )
        == 0
    )
    split = read_manifest(output).splits["train"]
    assert {key: getattr(split, key) for key in direct(documents)} == direct(documents)


def test_word_counts_follow_str_split_for_every_kind_of_whitespace():
    generator = random.Random(1)
    alphabet = ["a", "b", " ", "\t", "\u3000", "\xa0", "\u2028", "\x1c", "\u200b", "é", "\U0001f600", "\n", "\n"]
    for _ in range(2000):
        text = "".join(generator.choice(alphabet) for _ in range(generator.randint(1, 30)))
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        assert text_decoding.words_per_line(text).tolist() == [len(line.split()) for line in lines], repr(text)


def test_gzip_input_gives_the_shards_of_the_plain_text(ptb_word_tokenizer, ptb_text_dir, tmp_path):
    packed = tmp_path / "ptb.valid.txt.gz"
    packed.write_bytes(gzip.compress((ptb_text_dir / "ptb.valid.txt").read_bytes()))
    for name, source in (("plain", ptb_text_dir / "ptb.valid.txt"), ("gz", packed)):
        assert (
            run_build(
                "--tokenizer",
                ptb_word_tokenizer,
                "--output",
                tmp_path / name,
                "--split",
                f"valid={source}",
                "--tokens-per-block",
                1024,
                "--tokens-per-shard",
                20000,
            )
            == 0
        )
    plain, gz = files_of(tmp_path / "plain"), files_of(tmp_path / "gz")
    assert plain.pop(MANIFEST_NAME) != gz.pop(MANIFEST_NAME)  # it records the input names
    assert plain == gz and len(plain) == 4


def test_lm1b_layout_builds_train_valid_and_test(fabricated_lm1b_dir, ptb_word_tokenizer, tmp_path, capsys):
    ids = word_ids(ptb_word_tokenizer)
    output = tmp_path / "lm1b"
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            output,
            "--format",
            "lm1b",
            "--input",
            fabricated_lm1b_dir,
            "--workers",
            2,
        )
        == 0
    )
    manifest = read_manifest(output)
    assert sorted(manifest.splits) == ["test", "train", "valid"]
    inputs = manifest.build["inputs"]
    assert [Path(f["name"]).name for f in inputs["train"]] == list(published.LM1B_TRAIN_FILES)
    assert Path(inputs["valid"][0]["name"]).name == "news.en.heldout-00001-of-00050"
    assert Path(inputs["test"][0]["name"]).name == "news.en.heldout-00000-of-00050"
    for split in ("train", "valid", "test"):  # the fixture put PTB's split of the same name in each place
        expected = [i for s in ptb_sentences(split) for i in [ids[w] for w in s.split()] + [ids["<eos>"]]]
        assert read_split(output, split)[0].tolist() == expected
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            tmp_path / "bad",
            "--format",
            "lm1b",
            "--input",
            fabricated_lm1b_dir,
            "--lm1b-valid",
            "news.en.heldout-00000-of-00050",
        )
        == 2
    )
    assert "that is the test file; validating on it selects models on the test set" in capsys.readouterr().err
    empty = tmp_path / "empty_layout"
    (empty / published.LM1B_TRAIN_DIR).mkdir(parents=True)
    assert (
        run_build("--tokenizer", ptb_word_tokenizer, "--output", tmp_path / "bad", "--format", "lm1b", "--input", empty)
        == 2
    )
    assert f"{empty / published.LM1B_TRAIN_DIR / 'news.en-00001-of-00100'}: missing" in capsys.readouterr().err


def test_holdout_is_a_deterministic_hash_partition_of_train(ptb_word_tokenizer, ptb_text_dir, tmp_path, capsys):
    ids = word_ids(ptb_word_tokenizer)
    words = {i: w for w, i in ids.items()}
    output = tmp_path / "shards"
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            output,
            "--holdout",
            "valid=0.1",
            "--split",
            f"train={ptb_text_dir / 'ptb.train.txt'}",
            "--chunk-bytes",
            100000,
        )
        == 0
    )

    def sentences_of(split: str) -> list[str]:
        stream = read_split(output, split)[0].tolist()
        text = " ".join(words[i] for i in stream)
        return [s.strip() for s in text.split("<eos>")[:-1]]

    def held_out(sentence: str) -> bool:  # the documented rule: blake2b-64 of the document's text < fraction
        digest = hashlib.blake2b(sentence.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") < 0.1 * 2**64

    sentences = ptb_sentences("train")
    assert sentences_of("valid") == [" ".join(s.split()) for s in sentences if held_out(s)]
    assert sentences_of("train") == [" ".join(s.split()) for s in sentences if not held_out(s)]
    assert 0.08 < len(sentences_of("valid")) / len(sentences) < 0.12
    assert sorted(read_manifest(output).splits) == ["train", "valid"]
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            tmp_path / "bad",
            "--holdout",
            "valid=0.1",
            "--split",
            f"train={ptb_text_dir / 'ptb.train.txt'}",
            "--split",
            f"valid={ptb_text_dir / 'ptb.valid.txt'}",
        )
        == 2
    )
    assert "split 'valid' also has inputs" in capsys.readouterr().err


def test_missing_inputs_are_named(ptb_word_tokenizer, tmp_path, capsys):
    output = tmp_path / "shards"
    missing = tmp_path / "nowhere.txt"
    for spec, message in (
        (f"train={missing}", f"{missing}: no such input file"),
        (f"train={tmp_path}/*.nothing", f"{tmp_path}/*.nothing: no input file matches"),
        (f"train={tmp_path}", f"{tmp_path}: is a directory"),
    ):
        assert run_build("--tokenizer", ptb_word_tokenizer, "--output", output, "--split", spec) == 2
        assert message in capsys.readouterr().err
    assert run_build("--tokenizer", tmp_path / "no_tokenizer", "--output", output, "--split", f"train={missing}") == 2
    assert "no such" in capsys.readouterr().err
    assert not (output / MANIFEST_NAME).exists()


def test_non_utf8_bytes_are_replaced_and_counted_or_fail_with_strict(ptb_word_tokenizer, tmp_path, capsys):
    text = tmp_path / "bad.txt"
    text.write_bytes(b"the cat\n" + b"a \xff\xfe b\n" + b"ok \xe2\x82 end\n")  # 2 + 2 invalid bytes
    output = tmp_path / "replaced"
    assert run_build("--tokenizer", ptb_word_tokenizer, "--output", output, "--split", f"train={text}") == 0
    assert "4 non-UTF-8 bytes replaced" in capsys.readouterr().out
    manifest = read_manifest(output)
    assert manifest.build["statistics"]["train"]["replaced_bytes"] == 4
    assert manifest.splits["train"].documents == 3
    strict = tmp_path / "strict"
    assert run_build("--tokenizer", ptb_word_tokenizer, "--output", strict, "--split", f"train={text}", "--strict") == 2
    assert f"{text}: invalid UTF-8 at byte offset 10 (line 2)" in capsys.readouterr().err
    assert not any(p.suffix == ".tar" or p.name == MANIFEST_NAME for p in strict.iterdir())


def test_empty_documents_are_skipped_and_counted(ptb_word_tokenizer, tmp_path, capsys):
    lines = write_lines(tmp_path / "lines.txt", ["the cat", "", "   ", "\t", "a dog"])
    (tmp_path / "empty.txt").write_text(" \n\n")
    write_lines(tmp_path / "full.txt", ["the end"])
    output = tmp_path / "by_line"
    assert run_build("--tokenizer", ptb_word_tokenizer, "--output", output, "--split", f"train={lines}") == 0
    assert "2 documents, 6 tokens, 3 empty documents skipped" in capsys.readouterr().out
    assert read_manifest(output).build["statistics"]["train"]["empty_documents"] == 3
    output = tmp_path / "by_file"
    assert (
        run_build(
            "--tokenizer",
            ptb_word_tokenizer,
            "--output",
            output,
            "--doc-per",
            "file",
            "--split",
            f"train={tmp_path}/*.txt",
        )
        == 0
    )
    # lines.txt is one document of 5 lines (inner blank lines stay, each with its separator): 9 tokens.
    assert "2 documents, 12 tokens, 1 empty documents skipped" in capsys.readouterr().out


def test_output_directory_rules(ptb_word_tokenizer, ptb_text_dir, tmp_path, capsys):
    output = tmp_path / "shards"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    args = ["--tokenizer", ptb_word_tokenizer, "--output", output, "--split", f"test={ptb_text_dir / 'ptb.test.txt'}"]
    assert run_build(*args) == 2
    assert f"{output}: not empty (notes.txt); pass --overwrite" in capsys.readouterr().err
    assert run_build(*args, "--resume") == 2
    assert "no .build_state.json to resume from" in capsys.readouterr().err
    assert run_build(*args, "--overwrite") == 0
    assert (output / "notes.txt").exists() and (output / "test-000000.tar").exists()
    assert run_build(*args, "--resume") == 2
    assert "the build is complete" in capsys.readouterr().err
    assert run_build(*args, "--resume", "--overwrite") == 2
    assert "--resume and --overwrite exclude each other" in capsys.readouterr().err


def _interrupted_build(tokenizer: Path, text: Path, bad_offset: int, output: Path, *extra: str | int) -> list[str]:
    """A --strict build that fails at an invalid byte placed at ``bad_offset``; returns its arguments."""
    data = bytearray(text.read_bytes())
    data[bad_offset] = 0xFF
    text.write_bytes(bytes(data))
    args = [
        "--tokenizer",
        str(tokenizer),
        "--split",
        f"train={text}",
        "--strict",
        "--output",
        str(output),
        *map(str, extra),
    ]
    assert run_build(*args, "--workers", 2) == 2
    assert not (output / MANIFEST_NAME).exists()
    assert not [p for p in output.iterdir() if p.name.endswith(".partial")]
    return args


def _repair(text: Path, bad_offset: int) -> None:
    data = bytearray(text.read_bytes())
    data[bad_offset] = ord("x")
    text.write_bytes(bytes(data))


def test_interrupted_build_resumes_to_the_shards_of_an_uninterrupted_one(
    ptb_sentencepiece_tokenizer, ptb_text_dir, tmp_path, capsys
):
    text = tmp_path / "train.txt"
    text.write_bytes((ptb_text_dir / "ptb.train.txt").read_bytes())
    bad_offset = int(text.stat().st_size * 0.7)
    output = tmp_path / "resumed"
    args = _interrupted_build(
        ptb_sentencepiece_tokenizer,
        text,
        bad_offset,
        output,
        "--holdout",
        "dev=0.05",
        "--split",
        f"test={ptb_text_dir / 'ptb.test.txt'}",
        "--chunk-bytes",
        65536,
        "--tokens-per-block",
        2048,
        "--tokens-per-shard",
        32768,
    )
    assert f"{text}: invalid UTF-8 at byte offset {bad_offset}" in capsys.readouterr().err
    state = json.loads((output / build_shards.STATE_NAME).read_text())
    journaled = [s["path"] for stream in state["streams"].values() for s in stream["shards"]]
    assert {"train-000000.tar", "dev-000000.tar"} <= set(journaled)
    written = {name: (output / name).stat().st_mtime_ns for name in journaled}

    changed = [a if a != "32768" else "65536" for a in args]
    assert run_build(*changed, "--resume") == 2
    assert "the interrupted build used other settings (tokens_per_shard differ" in capsys.readouterr().err

    _repair(text, bad_offset)
    assert run_build(*args, "--resume", "--workers", 1) == 0
    assert {name: (output / name).stat().st_mtime_ns for name in journaled} == written  # not rewritten
    assert not (output / build_shards.STATE_NAME).exists()
    clean = tmp_path / "clean"
    assert run_build(*[a if a != str(output) else str(clean) for a in args]) == 0
    assert files_of(output) == files_of(clean)


def _stopped_inside_a_document(tokenizer: Path, tmp_path: Path) -> tuple[Path, int, Path, list]:
    """Paragraphs of 12 PTB sentences (documents per blank line), built until a damaged byte at 60% of the text
    stops the build inside a document: (text, the damaged offset, output, the build's arguments)."""
    sentences = ptb_sentences("valid")
    text = tmp_path / "paragraphs.txt"
    text.write_text("\n\n".join("\n".join(sentences[i : i + 12]) for i in range(0, 1200, 12)) + "\n")
    bad_offset = int(text.stat().st_size * 0.6)
    output = tmp_path / "resumed"
    args = _interrupted_build(
        tokenizer,
        text,
        bad_offset,
        output,
        "--doc-per",
        "blank-line",
        "--chunk-bytes",
        4096,
        "--tokens-per-block",
        64,
        "--tokens-per-shard",
        192,
    )
    return text, bad_offset, output, args


def test_resume_inside_long_documents(ptb_word_tokenizer, tmp_path):
    text, bad_offset, output, args = _stopped_inside_a_document(ptb_word_tokenizer, tmp_path)
    state = json.loads((output / build_shards.STATE_NAME).read_text())
    assert state["streams"]["train"]["position"]["skip_tokens"] > 0  # the build stopped inside a document
    _repair(text, bad_offset)
    assert run_build(*args, "--resume", "--workers", 2) == 0
    clean = tmp_path / "clean"
    assert run_build(*[a if a != str(output) else str(clean) for a in args]) == 0
    assert files_of(output) == files_of(clean)


def test_resume_refuses_a_damaged_shard(ptb_word_tokenizer, ptb_text_dir, tmp_path, capsys):
    text = tmp_path / "train.txt"
    text.write_bytes((ptb_text_dir / "ptb.train.txt").read_bytes())
    bad_offset = text.stat().st_size // 2
    output = tmp_path / "shards"
    args = _interrupted_build(ptb_word_tokenizer, text, bad_offset, output, "--tokens-per-shard", 100000)
    _repair(text, bad_offset)
    shard = output / "train-000001.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert run_build(*args, "--resume") == 2
    assert f"{shard}: sha256" in capsys.readouterr().err


def test_resume_refuses_changed_input_a_missing_shard_and_an_unreadable_journal(
    ptb_word_tokenizer, ptb_text_dir, tmp_path, capsys
):
    """Each refusal names the file and changes nothing: after it, the unchanged build still resumes to the shards
    of an uninterrupted one."""
    text = tmp_path / "train.txt"
    text.write_bytes((ptb_text_dir / "ptb.train.txt").read_bytes())
    bad_offset = text.stat().st_size // 2
    output = tmp_path / "shards"
    args = _interrupted_build(ptb_word_tokenizer, text, bad_offset, output, "--tokens-per-shard", 100000)
    _repair(text, bad_offset)
    state_path = output / build_shards.STATE_NAME
    kept = files_of(output)
    assert "train-000001.tar" in kept
    capsys.readouterr()

    original = text.read_bytes()
    text.write_bytes(original + b"one more line\n")
    assert run_build(*args, "--resume") == 2
    error = capsys.readouterr().err
    assert f"{state_path}: the interrupted build used other settings (inputs differ: " in error
    assert f'"size": {len(original)}' in error and f'"size": {len(original) + 14}' in error
    text.write_bytes(original)
    assert files_of(output) == kept

    shard = output / "train-000001.tar"
    shard.unlink()
    assert run_build(*args, "--resume") == 2
    assert f"{shard}: missing, but {state_path} lists it as written" in capsys.readouterr().err
    shard.write_bytes(kept["train-000001.tar"])

    state_path.write_text('{"settings": {"builder"')
    assert run_build(*args, "--resume") == 2
    assert f"{state_path}: unreadable resume state (" in capsys.readouterr().err
    state_path.write_bytes(kept[build_shards.STATE_NAME])
    assert files_of(output) == kept

    assert run_build(*args, "--resume") == 0
    clean = tmp_path / "clean"
    assert run_build(*[a if a != str(output) else str(clean) for a in args]) == 0
    assert files_of(output) == files_of(clean)


def test_input_that_changed_under_a_resume_inside_a_document_is_refused(ptb_word_tokenizer, tmp_path, capsys):
    """The size is the same, but the documents before the one the build stopped inside were merged: the split
    cannot continue inside that document, and the input's digest in the journal shows that it changed."""
    text, bad_offset, output, args = _stopped_inside_a_document(ptb_word_tokenizer, tmp_path)
    _repair(text, bad_offset)
    state = json.loads((output / build_shards.STATE_NAME).read_text())
    position, read_from = state["streams"]["train"]["position"], state["sources"]["train"]["read_from"]
    assert position["skip_tokens"] > 0 and position["document"] > 0
    data = text.read_bytes()
    # Join every paragraph of the chunk the build continues in up to its end: same bytes count, fewer documents.
    end = data.index(b"\n\n", read_from["offset"] + 4096)
    merged = data[: read_from["offset"]] + data[read_from["offset"] : end].replace(b"\n\n", b" \n") + data[end:]
    assert len(merged) == len(data)
    text.write_bytes(merged)
    capsys.readouterr()
    assert run_build(*args, "--resume") == 2
    # The journal's digest of the bytes read so far sees the change before the packer would.
    assert f"{text}: changed since the interrupted build" in capsys.readouterr().err
    assert not (output / MANIFEST_NAME).exists() and (output / build_shards.STATE_NAME).exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--split", "train=X", "--input", "."],
            "--input is for --format lm1b|ptb|wikitext|enwik8|text8; give text inputs with --split",
        ),
        (["--format", "lm1b", "--split", "train=X"], "--split is for --format text; --format lm1b defines"),
        (
            ["--format", "ptb", "--doc-per", "blank-line"],
            "--doc-per blank-line: --format ptb has one sentence per line",
        ),
        (["--format", "lm1b"], "--format lm1b needs --input DIR"),
        ([], "no split to build: give --split NAME=GLOB"),
        (["--split", "train-1=X"], "split name 'train-1': use letters, digits and '_' only"),
        (["--split", "train=X", "--tokens-per-block", "0"], "--tokens-per-block 0: must be positive"),
        (["--split", "train=X", "--chunk-bytes", "-1"], "--chunk-bytes -1: must be positive"),
        (
            ["--split", "train=X", "--tokens-per-block", "4096", "--tokens-per-shard", "4095"],
            "--tokens-per-shard 4095 is smaller than --tokens-per-block 4096",
        ),
        (["--split", "train=X", "--holdout", "valid=1.5"], "--holdout valid=1.5: the fraction must lie in (0, 1)"),
        (["--split", "main=X", "--holdout", "valid=0.1"], "--holdout takes documents from split 'train', which is not"),
        (["--split", "train=X", "--workers", "0"], "--workers 0: must be at least 1"),
    ],
)
def test_flag_combinations_that_cannot_build_are_refused(
    flags, message, ptb_word_tokenizer, ptb_text_dir, tmp_path, capsys
):
    flags = [flag.replace("X", str(ptb_text_dir / "ptb.test.txt")) for flag in flags]
    output = tmp_path / "shards"
    assert run_build("--tokenizer", ptb_word_tokenizer, "--output", output, *flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("build_shards: error: ") and message in lines[0], lines
    assert not output.exists() or not any(output.iterdir())


def test_an_interrupt_while_a_shard_is_being_opened_leaves_no_partial_file(tmp_path, monkeypatch):
    # Ctrl-C can land between the creation of a shard's partial file and the writer's note of it.
    from data_tools.shards import writer

    real_tar_writer, opened = writer.wds.TarWriter, []

    def tar_writer_interrupted_on_the_second_shard(*args, **kwargs):
        opened.append(args)
        if len(opened) == 2:
            raise KeyboardInterrupt
        return real_tar_writer(*args, **kwargs)

    monkeypatch.setattr(writer.wds, "TarWriter", tar_writer_interrupted_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        with writer.ShardWriter(tmp_path, "train", vocab_size=10, dtype=np.uint16, tokens_per_shard=4) as shards:
            for _ in range(3):
                shards.add_block(np.array([3, 4, 5, 0]), np.array([0]))
    assert len(opened) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train-000000.tar"]


def test_keyboard_interrupt_keeps_finished_shards_for_resume(ptb_word_tokenizer, ptb_text_dir, tmp_path):
    text = tmp_path / "train.txt"
    text.write_bytes((ptb_text_dir / "ptb.train.txt").read_bytes() * 4)
    output = tmp_path / "shards"
    args = [
        "--tokenizer",
        str(ptb_word_tokenizer),
        "--split",
        f"train={text}",
        "--output",
        str(output),
        "--tokens-per-block",
        "4096",
        "--tokens-per-shard",
        "50000",
        "--no-progress",
    ]
    # A shell's background job starts with SIGINT ignored, which the build would inherit: restore it.
    process = subprocess.Popen(
        [sys.executable, "-m", "data_tools.build_shards", *args, "--workers", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not (output / "train-000000.tar").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert re.search(r"build_shards: interrupted.*\(.*\.build_state\.json.*\): rerun with --resume\n", stderr), stderr
    assert not (output / MANIFEST_NAME).exists()
    assert not [p for p in output.iterdir() if p.name.endswith((".partial", ".tmp"))]
    assert (output / build_shards.STATE_NAME).exists()
    assert build_shards.main(args + ["--resume"]) == 0
    manifest = read_manifest(output)
    assert manifest.splits["train"].documents == 4 * len(ptb_sentences("train"))
    assert inspect_shards.verify_shards(output) == []


@pytest.mark.parametrize(
    ("interrupted_at", "said"),
    [
        ("the output's check", "interrupted before anything was written (no shard, no journal): nothing to resume"),
        ("the first shard", "interrupted before the first shard was finished ({journal} is kept): rerun with --resume"),
        (
            "the second shard",
            "interrupted; the finished shards are kept (1 in {output}, with {journal}): rerun with --",
        ),
    ],
)
def test_ctrl_c_says_what_the_build_left_and_resume_finishes_it(
    interrupted_at, said, ptb_word_tokenizer, ptb_text_dir, tmp_path, monkeypatch, capsys
):
    """Ctrl-C (KeyboardInterrupt, raised where it can land) before the output exists, before the first shard is
    finished, after one: the line says what is true of the output folder, and the advice it gives works."""
    from data_tools.shards import builder, writer

    output = tmp_path / "shards"
    args = ["--tokenizer", ptb_word_tokenizer, "--split", f"train={ptb_text_dir / 'ptb.valid.txt'}", "--output", output]
    args += ["--tokens-per-block", "4096", "--tokens-per-shard", "20000"]
    real_tar_writer, opened = writer.wds.TarWriter, []

    def interrupted_at_the_shard(*writer_args, **kwargs):
        opened.append(writer_args)
        if len(opened) == {"the first shard": 1, "the second shard": 2}[interrupted_at]:
            raise KeyboardInterrupt
        return real_tar_writer(*writer_args, **kwargs)

    def interrupted_at_the_check(*check_args):
        raise KeyboardInterrupt

    if interrupted_at == "the output's check":
        monkeypatch.setattr(builder, "refuse_output_over_inputs", interrupted_at_the_check)
    else:
        monkeypatch.setattr(writer.wds, "TarWriter", interrupted_at_the_shard)
    assert run_build(*args) == 130
    line = said.format(output=output, journal=output / build_shards.STATE_NAME)
    err = capsys.readouterr().err
    assert err.startswith(f"build_shards: {line}") and err.count("\n") == 1, err
    assert output.exists() == (interrupted_at != "the output's check")
    monkeypatch.undo()
    assert run_build(*args, *(["--resume"] if output.exists() else [])) == 0
    assert inspect_shards.verify_shards(output) == []


def test_word_tokenizer_numpy_and_str_paths_give_one_stream(ptb_word_tokenizer, tmp_path):
    """Chunks of plain text take the word tokenizer's numpy path, chunks with no-break spaces, CRLF, NUL or
    bytes that are not UTF-8 the str path; the shards hold the exact stream and counts either way, for any
    number of workers."""
    tokenizer = load_tokenizer(ptb_word_tokenizer)
    sentences = ptb_sentences("valid")[:3000]
    odd = ["the\xa0market fell", "it rose\r", "a\x00b c", "  \t ", "n't \u3000 stop", "words café naïve"]
    lines = [odd[i // 100 % len(odd)] if i % 100 == 50 else s for i, s in enumerate(sentences)]
    data = "\n".join(lines).encode() + b"\nbad \xff byte\n"
    text = tmp_path / "mixed.txt"
    text.write_bytes(data)
    decoded = data.decode("utf-8", "replace").replace("\r\n", "\n").split("\n")[:-1]
    documents = [[line] for line in decoded if line.split()]
    expected, _ = tokenizer.encode_documents(documents)
    outputs = {}
    for workers in (1, 2):
        outputs[workers] = tmp_path / f"workers{workers}"
        assert (
            run_build(
                "--tokenizer",
                ptb_word_tokenizer,
                "--output",
                outputs[workers],
                "--split",
                f"train={text}",
                "--chunk-bytes",
                4096,
                "--tokens-per-block",
                1000,
                "--tokens-per-shard",
                20000,
                "--workers",
                workers,
            )
            == 0
        )
    assert files_of(outputs[1]) == files_of(outputs[2])
    stream, _, _ = read_split(outputs[1], "train")
    assert stream.tolist() == expected.tolist()
    split = read_manifest(outputs[1]).splits["train"]
    assert (split.documents, split.words) == (len(documents), sum(len(d[0].split()) + 1 for d in documents))
    assert split.characters == sum(len(d[0]) + 1 for d in documents)
    statistics = read_manifest(outputs[1]).build["statistics"]["train"]
    assert statistics["empty_documents"] == len(decoded) - len(documents) == 5 and statistics["replaced_bytes"] == 1


def test_chunks_travel_to_workers_without_their_bytes_and_are_checked_when_read_again(tmp_path):
    text = write_lines(tmp_path / "a.txt", [f"line {i} of the text" for i in range(2000)])
    packed = tmp_path / "b.txt.gz"
    packed.write_bytes(gzip.compress(text.read_bytes()))
    plain_chunks = list(chunking.read_chunks(input_files([str(text)]), "line", 4096))
    travelling = [chunking.portable(chunk) for chunk in plain_chunks]
    assert all(chunk.data is None for chunk in travelling) and len(plain_chunks) > 5
    assert [chunking.resolve(chunk).data for chunk in travelling] == [chunk.data for chunk in plain_chunks]
    gz_chunk = next(chunking.read_chunks(input_files([str(packed)]), "line", 4096))
    assert chunking.portable(gz_chunk) is gz_chunk  # offsets of decompressed bytes: it travels with its bytes
    data = bytearray(text.read_bytes())
    data[travelling[2].start.offset + 3] ^= 1  # one bit flipped, same size
    text.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"a\.txt, bytes \d+-\d+: the file changed while it was being read"):
        chunking.resolve(travelling[2])
    assert chunking.resolve(travelling[1]).data == plain_chunks[1].data
