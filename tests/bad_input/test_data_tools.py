"""Bad input to the data tools (data_tools.build_shards, train_tokenizer) and to the corpus generators of the tests
(benchmarks.corpora.synthetic_charlm, synthetic_lm1b): inputs inside the output, flags that do not apply or are
given twice, damaged and misnamed character corpora, byte and char tokenizers on every input path, the synthetic
corpora's outputs and numbers, Ctrl-C and a killed run's staging folder, and a resumed build whose input changed at
the same size.

Every refusal is one line naming the file or flag, exit status 2, with nothing left that a later step trusts."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks.corpora import synthetic_charlm
from data_tools import build_shards, train_tokenizer
from tests.conftest import ptb_sentences
from tests.launcher import REPO
from tests.test_build_shards import files_of, read_split
from txl_dist.data.format import MANIFEST_NAME
from txl_dist.tokenizer import load_tokenizer

HELD_OUT = 5_000


def _run(module, argv: list, capsys) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of a command's main, in this process."""
    status = module.main([str(a) for a in argv] + ["--no-progress"])
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines(), captured.out


def _refused(module, argv: list, capsys, *expected: str) -> str:
    """Run a command that must refuse: status 2, one line starting with its name, holding each of ``expected``."""
    status, lines, _ = _run(module, argv, capsys)
    name = module.__name__.rsplit(".", 1)[-1]
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"{name}: error: "), (status, lines)
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Small enwik8 and text8 files with their zips, and a byte and a char tokenizer."""
    root = tmp_path_factory.mktemp("corpora")
    paths = {}
    # text8's words (quick to make at this size), and for enwik8 the same with line ends and a byte not UTF-8.
    text8 = synthetic_charlm.text8_bytes(40_000)
    enwik8 = (text8.replace(b"a ", b"a\n") + b"\xff\n") * 2
    for kind, data in (("enwik8", enwik8), ("text8", text8)):
        paths[kind] = root / kind / kind
        paths[kind].parent.mkdir()
        paths[kind].write_bytes(data)
        with zipfile.ZipFile(paths[kind].with_name(f"{kind}.zip"), "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(kind, data)
    assert (
        train_tokenizer.main(["--kind", "byte", "--input", str(paths["enwik8"]), "--output", str(root / "byte")]) == 0
    )
    paths["byte"] = root / "byte"
    return paths


def _damaged_zip(source: Path, destination: Path) -> Path:
    """A copy of a zip with 64 bytes inside its deflate stream XOR-ed (its directory and headers intact)."""
    with zipfile.ZipFile(source) as archive:
        info = archive.infolist()[0]
    data = bytearray(source.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + info.compress_size // 3
    for offset in range(start, start + 64):
        data[offset] ^= 0x5A
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(bytes(data))
    return destination


# ---- inputs inside the output are never deleted ----------------------------------------------------------------------


def test_build_shards_refuses_inputs_inside_its_output_before_deleting_anything(
    ptb_word_tokenizer, small_shards, tmp_path, capsys
):
    shards = tmp_path / "shards"
    shutil.copytree(small_shards, shards)
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    status = build_shards.main(
        [
            "--tokenizer",
            str(ptb_word_tokenizer),
            "--output",
            str(shards),
            "--overwrite",
            "--split",
            f"train={shards}/train*",
            "--no-progress",
        ]
    )
    error = capsys.readouterr().err
    assert status == 2 and error.count("\n") == 1
    assert f"output {shards} contains the input {shards}/train-000000.tar" in error
    assert {p.name: p.read_bytes() for p in shards.iterdir()} == before  # manifest.json and shards kept


def test_train_tokenizer_refuses_inputs_inside_its_output(tmp_path, capsys):
    from data_tools import train_tokenizer

    text = tmp_path / "tok" / "corpus.txt"
    text.parent.mkdir()
    text.write_text("a b c\n")
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--input", str(text), "--output", str(tmp_path / "tok"), "--overwrite", "--no-progress"]
        )
        == 2
    )
    assert f"contains the input {text}" in capsys.readouterr().err
    assert text.read_text() == "a b c\n"


def test_train_tokenizer_leaves_no_empty_output_folder_when_it_refuses_its_input(tmp_path, capsys):
    from data_tools import train_tokenizer

    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--input", str(empty), "--output", str(tmp_path / "new" / "tok"), "--no-progress"]
        )
        == 2
    )
    assert "no document in the input" in capsys.readouterr().err
    assert not (tmp_path / "new" / "tok").exists()


# ---- flags that do not apply, or are given twice ---------------------------------------------------------------------


def test_a_second_holdout_is_refused_not_dropped(ptb_word_tokenizer, tmp_path, capsys):
    text = tmp_path / "train.txt"
    text.write_text("".join(line + "\n" for line in ptb_sentences("valid")[:50]))
    status = build_shards.main(
        [
            "--tokenizer",
            str(ptb_word_tokenizer),
            "--output",
            str(tmp_path / "shards"),
            "--split",
            f"train={text}",
            "--holdout",
            "valid=0.05",
            "--holdout",
            "test=0.05",
            "--no-progress",
        ]
    )
    error = capsys.readouterr().err
    assert status == 2 and error.count("\n") == 1
    assert "--holdout is given 2 times (valid=0.05, test=0.05)" in error
    assert not (tmp_path / "shards").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--split", "train=TEXT", "--held-out-bytes", "1000"], "--held-out-bytes 1000: applies to --format enwik8"),
        (["--format", "ptb", "--held-out-bytes", "1000"], "not to --format ptb"),
        (["--split", "train=TEXT", "--lm1b-valid", "x"], "--lm1b-valid x: applies to --format lm1b only"),
        (["--split", "train=TEXT", "--jsonl-field", "body"], "--jsonl-field body: no input is a .jsonl file"),
        (["--split", "train=TEXT", "--strict"], "--strict: "),
        (["--split", "train=TEXT", "--workers", "two"], "--workers"),
        (["--split", "train=JSONL", "--doc-per", "blank-line"], "--doc-per blank-line: every input is .jsonl"),
        (["--split", "train=TEXT", "--doc-per", "file", "--chunk-bytes", "4096"], "--chunk-bytes 4096: with --doc"),
    ],
)
def test_build_shards_refuses_flags_that_do_not_apply(flags, message, corpora, ptb_text_dir, tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    records.write_text('{"text": "a b"}\n')
    flags = [f.replace("TEXT", str(ptb_text_dir / "ptb.valid.txt")).replace("JSONL", str(records)) for f in flags]
    argv = ["--tokenizer", corpora["byte"], "--output", tmp_path / "shards", *flags]
    if "--workers" in flags:  # argparse's own refusals are one line too
        with pytest.raises(SystemExit) as stopped:
            build_shards.main([str(a) for a in argv])
        assert stopped.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("build_shards: error: ") and message in lines[0], lines
    else:
        _refused(build_shards, argv, capsys, message)
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kind", "word", "--vocab-size", "100"], "--vocab-size: applies to --kind sentencepiece only"),
        (["--kind", "word", "--eod-symbol", "<eod>"], "--eod-symbol: applies to --kind sentencepiece only"),
        (["--kind", "byte", "--alphabet", "abc"], "--alphabet: applies to --kind char only, not to --kind byte"),
        (["--kind", "char", "--min-count", "2"], "--min-count: applies to --kind word only"),
        (["--kind", "sentencepiece", "--specials", "<x>"], "--specials: applies to --kind word only"),
        (["--kind", "byte", "--workers", "2"], "--workers: applies to --kind word only"),
        (["--kind", "word", "--held-out-bytes", "10"], "--held-out-bytes 10: applies to --format enwik8|text8"),
        (["--kind", "byte", "--doc-per", "blank-line"], "--doc-per blank-line: a byte tokenizer's vocabulary"),
        (["--kind", "char", "--doc-per", "file"], "--doc-per file: a char tokenizer's vocabulary"),
        (["--kind", "byte", "--strict"], "--strict: a byte tokenizer keeps every byte"),
        (["--kind", "word", "--jsonl-field", "body"], "--jsonl-field body: no input is a .jsonl file"),
        (["--kind", "sentencepiece", "--allow-empty"], "--allow-empty: a sentencepiece model cannot be trained"),
    ],
)
def test_train_tokenizer_refuses_flags_that_do_not_apply(flags, message, ptb_text_dir, tmp_path, capsys):
    argv = [*flags, "--input", ptb_text_dir / "ptb.valid.txt", "--output", tmp_path / "tok"]
    _refused(train_tokenizer, argv, capsys, message)
    assert not (tmp_path / "tok").exists()


# ---- character corpora: damaged and misnamed zip archives ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["enwik8", "text8"])
def test_a_damaged_zip_member_is_refused_before_anything_is_written(kind, corpora, tmp_path, capsys):
    # The train range ends before the member's end, where zipfile would have checked the CRC.
    damaged = _damaged_zip(corpora[kind].with_name(f"{kind}.zip"), tmp_path / "bad" / f"{kind}.zip")
    common = ["--format", kind, "--input", damaged, "--held-out-bytes", HELD_OUT]
    _refused(
        train_tokenizer, ["--preset", kind, *common, "--output", tmp_path / "tok"], capsys, str(damaged), "damaged"
    )
    assert not (tmp_path / "tok").exists()
    tokenizer = corpora["byte"] if kind == "enwik8" else None
    if tokenizer is None:
        assert (
            train_tokenizer.main(["--preset", "text8", "--input", str(corpora[kind]), "--output", str(tmp_path / "t")])
            == 0
        )
        tokenizer = tmp_path / "t"
    capsys.readouterr()
    _refused(build_shards, ["--tokenizer", tokenizer, *common, "--output", tmp_path / "shards"], capsys, "damaged")
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())


def test_a_zip_under_the_raw_name_and_an_ambiguous_folder_are_refused(corpora, tmp_path, capsys):
    archive = corpora["enwik8"].with_name("enwik8.zip")
    misnamed = tmp_path / "misnamed" / "enwik8"
    misnamed.parent.mkdir()
    shutil.copy(archive, misnamed)
    for command, argv in (
        (train_tokenizer, ["--kind", "byte", "--format", "enwik8", "--output", tmp_path / "tok"]),
        (build_shards, ["--tokenizer", corpora["byte"], "--format", "enwik8", "--output", tmp_path / "shards"]),
    ):
        for given in (misnamed, misnamed.parent):  # the file, and the folder holding it
            _refused(command, [*argv, "--input", given, "--held-out-bytes", HELD_OUT], capsys, "is a zip archive")
    # A partial raw file beside the full zip: which one was meant is not the importer's to guess.
    both = tmp_path / "both"
    both.mkdir()
    shutil.copy(archive, both / "enwik8.zip")
    (both / "enwik8").write_bytes(corpora["enwik8"].read_bytes()[:30_000])
    argv = ["--tokenizer", corpora["byte"], "--format", "enwik8", "--input", both, "--output", tmp_path / "s"]
    _refused(build_shards, [*argv, "--held-out-bytes", HELD_OUT], capsys, f"{both}: holds both enwik8 and enwik8.zip")
    # The summary line says which file (and member) was read.
    (both / "enwik8").unlink()
    status, _, out = _run(build_shards, [*argv, "--held-out-bytes", HELD_OUT], capsys)
    assert status == 0 and out.strip().endswith(f"read {(both / 'enwik8.zip').resolve()} (its member enwik8)"), out
    # A zip given as a text input is not read as text.
    _refused(
        build_shards,
        ["--tokenizer", corpora["byte"], "--split", f"train={archive}", "--output", tmp_path / "z"],
        capsys,
        f"{archive}: is a zip archive",
    )


# ---- byte and char tokenizers on every input path --------------------------------------------------------------------


# Blank and whitespace-only lines, CRLF, a byte that is not UTF-8, characters of 2 to 4 bytes, no final newline.
RAW = b"first line\r\n\n  \n\tsecond \xe9t\xc3\xa9\n\n\nthird \xf0\x9d\x84\x9e para\r\nstill third\n \nlast"


def _stream(directory: Path, split: str) -> bytes:
    tokens = read_split(directory, split)[0]
    return bytes(tokens.astype(np.uint8).tolist())


def test_a_byte_tokenizer_keeps_every_byte_on_every_path(corpora, tmp_path, capsys):
    text = tmp_path / "raw.txt"
    text.write_bytes(RAW * 40)
    byte = corpora["byte"]
    common = ["--tokenizer", byte, "--tokens-per-block", 512, "--tokens-per-shard", 4096]
    # --holdout: each line goes whole to one split; together the splits hold every line, blank ones included.
    assert (
        _run(
            build_shards,
            [*common, "--split", f"train={text}", "--holdout", "valid=0.3", "--output", tmp_path / "holdout"],
            capsys,
        )[0]
        == 0
    )
    train, valid = _stream(tmp_path / "holdout", "train"), _stream(tmp_path / "holdout", "valid")
    assert train and valid and len(train) + len(valid) == len(RAW * 40) + 1
    expected_lines = (RAW * 40 + b"\n").split(b"\n")[:-1]
    assert sorted(train.split(b"\n")[:-1] + valid.split(b"\n")[:-1]) == sorted(expected_lines)
    # --doc-per blank-line and file: the documents one after another are the file itself.
    for unit in ("blank-line", "file"):
        output = tmp_path / unit
        assert (
            _run(build_shards, [*common, "--split", f"train={text}", "--doc-per", unit, "--output", output], capsys)[0]
            == 0
        )
        assert _stream(output, "train") == RAW * 40 + b"\n", unit
    # .jsonl: each record's text field, as JSON decodes it, and one newline.
    fields = ["a\r\nb", "", "  ", "caf\u00e9\n\n", "\t\U0001d11e"]
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"text": f}) + "\n" for f in fields) + "\n", encoding="utf-8")
    status, _, out = _run(build_shards, [*common, "--split", f"train={records}", "--output", tmp_path / "j"], capsys)
    assert status == 0 and "1 empty documents skipped" in out
    assert _stream(tmp_path / "j", "train") == b"".join(f.encode() + b"\n" for f in fields if f)


def test_char_tokenizers_learn_from_jsonl_fields_and_keep_every_character(tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    fields = ["ab\r\nc", "", "b  a\n\nc", "\u00e9a"]
    records.write_text("".join(json.dumps({"body": f}) + "\n" for f in fields), encoding="utf-8")
    argv = ["--kind", "char", "--input", records, "--jsonl-field", "body", "--output", tmp_path / "tok"]
    assert _run(train_tokenizer, argv, capsys)[0] == 0
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert set(tokenizer.characters) == set("".join(fields)) | {"\n"}  # no '{', '"' or ':' of the JSON
    # The general path (--holdout, --doc-per blank-line, .jsonl) keeps every character as the byte path does.
    text = tmp_path / "text.txt"
    text.write_text("ab c\r\n\n  \nba\u00e9\n\nc" * 30, encoding="utf-8", newline="")
    common = ["--tokenizer", tmp_path / "tok", "--tokens-per-block", 512, "--tokens-per-shard", 4096]
    out = tmp_path / "blank"
    assert (
        _run(build_shards, [*common, "--split", f"train={text}", "--doc-per", "blank-line", "--output", out], capsys)[0]
        == 0
    )
    assert tokenizer.decode(read_split(out, "train")[0].tolist()) == text.read_bytes().decode() + "\n"
    out = tmp_path / "holdout"
    assert (
        _run(build_shards, [*common, "--split", f"train={text}", "--holdout", "valid=0.4", "--output", out], capsys)[0]
        == 0
    )
    lines = [tokenizer.decode(read_split(out, s)[0].tolist()).split("\n")[:-1] for s in ("train", "valid")]
    assert sorted(lines[0] + lines[1]) == sorted((text.read_bytes().decode() + "\n").split("\n")[:-1])
    out = tmp_path / "jsonl"
    assert (
        _run(build_shards, [*common, "--split", f"train={records}", "--jsonl-field", "body", "--output", out], capsys)[
            0
        ]
        == 0
    )
    assert tokenizer.decode(read_split(out, "train")[0].tolist()) == "".join(f + "\n" for f in fields if f)


def test_char_tokenizers_name_the_file_and_place_of_what_they_cannot_encode(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("abc\nab\n", encoding="utf-8")
    assert _run(train_tokenizer, ["--kind", "char", "--input", text, "--output", tmp_path / "tok"], capsys)[0] == 0
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"abc\nca\xe9\n")
    # Training: not the advice to drop a --strict that was never given.
    line = _refused(
        train_tokenizer,
        ["--kind", "char", "--input", latin1, "--output", tmp_path / "t2"],
        capsys,
        f"{latin1}: invalid UTF-8 at byte offset 6 (line 2)",
        "convert the file to UTF-8",
    )
    assert "--strict" not in line and not (tmp_path / "t2").exists()
    outside = tmp_path / "outside.txt"
    outside.write_text("abc\nabd\n", encoding="utf-8")
    _refused(
        train_tokenizer,
        ["--kind", "char", "--alphabet", "abc", "--input", outside, "--output", tmp_path / "t3"],
        capsys,
        f"{outside}: character 'd' (U+0064) at byte offset 6 (line 2) is not in --alphabet 'abc'",
    )
    # Building, on every path: one line naming the file, the character and where it is.
    common = ["--tokenizer", tmp_path / "tok"]
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "ab"}\n{"text": "abd"}\n', encoding="utf-8")
    for case, (flags, expected) in enumerate(
        [
            (
                ["--split", f"train={outside}", "--holdout", "valid=0.5"],
                f"{outside}: character 'd' (U+0064) at byte offset 6 (line 2)",
            ),
            (
                ["--split", f"train={outside}", "--doc-per", "blank-line"],
                f"{outside}: character 'd' (U+0064) at byte offset 6 (line 2)",
            ),
            (["--split", f"train={outside}"], f"{outside}: character 'd' (U+0064) at byte offset 6 (line 2)"),
            (["--split", f"train={records}"], f"{records}, line 2, field 'text': character 'd' (U+0064"),
            (
                ["--split", f"train={latin1}", "--holdout", "valid=0.5"],
                f"{latin1}: invalid UTF-8 at byte offset 6 (line 2)",
            ),
            (["--split", f"train={latin1}"], f"{latin1}: invalid UTF-8 at byte offset 6 (line 2)"),
        ]
    ):
        line = _refused(build_shards, [*common, *flags, "--output", tmp_path / f"s{case}"], capsys, expected)
        assert "--strict" not in line
        assert not (tmp_path / f"s{case}" / MANIFEST_NAME).exists()


# ---- synthetic_charlm and synthetic_lm1b: their outputs and numbers --------------------------------------------------


def test_synthetic_charlm_refuses_existing_outputs_and_bad_numbers(tmp_path, capsys):
    def refused(argv: list, expected: str) -> None:
        try:
            status = synthetic_charlm.main([str(a) for a in argv])
        except SystemExit as stopped:
            status = stopped.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and lines[0].startswith("synthetic_charlm: error: "), lines
        assert expected in lines[0], lines[0]

    existing = tmp_path / "text8"
    existing.write_bytes(b"mine")
    refused(["text8", "--output", tmp_path, "--bytes", 100], f"{tmp_path}: is a directory")
    refused(["text8", "--output", existing, "--bytes", 100], f"{existing}: exists; pass --overwrite")
    assert existing.read_bytes() == b"mine"
    assert synthetic_charlm.main(["text8", "--output", str(existing), "--bytes", "100", "--overwrite"]) == 0
    assert len(existing.read_bytes()) == 100
    refused(["wikitext", "--output", existing, "--train-words", 100], f"{existing}: exists and is not a directory")
    for flags, expected in (
        (["--seed", -1], "--seed -1: must lie in [0, "),
        (["--bytes", 0], "--bytes 0: must lie in [1, "),
        (["--bytes", 10**13], "--bytes 10000000000000: must lie in [1, "),
        (["--bytes", "many"], "--bytes"),
        (["--train-words", 5], "--train-words: does not apply to the text8 layout"),
    ):
        refused(["text8", "--output", tmp_path / "new", *flags], expected)
    refused(["wikitext", "--output", tmp_path / "w", "--train-words", -5], "--train-words -5: must lie in [1, ")
    assert not (tmp_path / "new").exists() and not (tmp_path / "w").exists()


@pytest.mark.parametrize("kind", ["dangling link", "file"])
def test_synthetic_lm1b_into_a_dangling_link_or_a_file_is_one_line(tmp_path, capsys, kind):
    from benchmarks.corpora import synthetic_lm1b

    output = tmp_path / "out"
    if kind == "file":
        output.write_text("mine")
    else:
        output.symlink_to(tmp_path / "gone")
    with pytest.raises(SystemExit) as exited:  # was a FileExistsError traceback
        synthetic_lm1b.main(["--output", str(output), "--scale", "0.0001", "--no-progress"])
    assert exited.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(f"synthetic_lm1b: error: {output}: ")  # the data tools' one-line format (OneLineParser)
    )


# ---- Ctrl-C, and the staging folder of a killed run ------------------------------------------------------------------


def _interrupt(argv: list[str], output: Path, started=None) -> tuple[int, str]:
    """Start a data tool, send SIGINT once ``started(pid)`` (default: its staging folder exists in ``output``),
    and return (status, stderr)."""
    # A shell's background job starts with SIGINT ignored, which the command would inherit: restore it.
    process = subprocess.Popen(
        [sys.executable, "-m", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        if started is not None and started(process.pid):
            break
        if (
            started is None
            and output.is_dir()
            and any(p.name.startswith(train_tokenizer.STAGING_PREFIX) for p in output.iterdir())
        ):
            break
        time.sleep(0.01)
    time.sleep(0.05)  # into the reading
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    return process.returncode, stderr


@pytest.fixture(scope="module")
def long_text(tmp_path_factory, ptb_text_dir) -> Path:
    """About 50 MB of PTB sentences: a second or more of reading, time enough to be interrupted in."""
    path = tmp_path_factory.mktemp("long") / "long.txt"
    path.write_bytes((ptb_text_dir / "ptb.train.txt").read_bytes() * 10)
    return path


def test_ctrl_c_during_word_training_leaves_no_output_folder(long_text, tmp_path):
    output = tmp_path / "new" / "tok"
    status, stderr = _interrupt(
        [
            "data_tools.train_tokenizer",
            "--kind",
            "word",
            "--input",
            str(long_text),
            "--output",
            str(output),
            "--no-progress",
        ],
        output,
    )
    assert status == 130 and stderr.strip().splitlines() == [
        f"train_tokenizer: interrupted; nothing written, {output} removed again"
    ], stderr
    assert not output.exists()


def test_ctrl_c_during_sentencepiece_training_keeps_the_tokenizer_it_would_overwrite(
    long_text, ptb_word_tokenizer, tmp_path
):
    output = tmp_path / "tok"
    shutil.copytree(ptb_word_tokenizer, output)
    before = files_of(output)
    argv = ["data_tools.train_tokenizer", "--kind", "sentencepiece", "--vocab-size", "500", "--input", str(long_text)]
    status, stderr = _interrupt([*argv, "--output", str(output), "--overwrite", "--no-progress"], output)
    assert status == 130 and stderr.strip().splitlines() == [
        f"train_tokenizer: interrupted; nothing written, {output} left as it was"
    ], stderr
    assert files_of(output) == before
    load_tokenizer(output)


def test_ctrl_c_during_synthetic_charlm_leaves_no_partial_file(tmp_path):
    output = tmp_path / "corpus" / "enwik8"
    argv = ["benchmarks.corpora.synthetic_charlm", "enwik8", "--output", str(output), "--bytes", "40000000", "--zip"]
    # Started: past its imports (32 MB resident), its memory grows with the corpus it builds.
    status, stderr = _interrupt(argv, output, started=lambda pid: _resident_mb(pid) > 60)
    assert status == 130 and stderr.strip().splitlines() == [
        f"synthetic_charlm: interrupted; no partial file left in {output}"
    ], stderr
    assert not output.parent.exists() or list(output.parent.iterdir()) == []


def _resident_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0.0)


def test_a_killed_runs_staging_folder_does_not_block_the_next_run(ptb_text_dir, tmp_path, capsys):
    output = tmp_path / "tok"
    stale = output / f"{train_tokenizer.STAGING_PREFIX}999999999"  # no such process
    stale.mkdir(parents=True)
    (stale / "vocab.txt").write_text("half\n")
    argv = ["--kind", "word", "--input", ptb_text_dir / "ptb.valid.txt", "--output", output]
    assert _run(train_tokenizer, argv, capsys)[0] == 0
    assert sorted(p.name for p in output.iterdir()) == ["tokenizer.json", "vocab.txt"]


# ---- a resumed build whose input changed -----------------------------------------------------------------------------


def test_resume_refuses_an_input_changed_at_the_same_size(ptb_word_tokenizer, ptb_text_dir, tmp_path, capsys):
    text = tmp_path / "train.txt"
    original = (ptb_text_dir / "ptb.valid.txt").read_bytes()
    bad_offset = len(original) * 3 // 4
    stopped = bytearray(original)
    stopped[bad_offset] = 0xFF  # stops a --strict build there, after some shards
    text.write_bytes(bytes(stopped))
    output = tmp_path / "shards"
    args = [
        "--tokenizer",
        ptb_word_tokenizer,
        "--split",
        f"train={text}",
        "--strict",
        "--output",
        output,
        "--chunk-bytes",
        8192,
        "--tokens-per-block",
        1024,
        "--tokens-per-shard",
        8192,
    ]
    assert _run(build_shards, args, capsys)[0] != 0
    assert any(p.name.endswith(".tar") for p in output.iterdir())
    kept = files_of(output)
    # One byte changed early in the file (a letter for another, the size the same), and the invalid one fixed.
    changed = bytearray(original)
    position = changed.index(b"the ", 100)
    changed[position : position + 3] = b"tha"
    text.write_bytes(bytes(changed))
    _refused(build_shards, [*args, "--resume"], capsys, f"{text}: changed since the interrupted build")
    assert files_of(output) == kept
    # As it was, less the invalid byte (after what the finished shards hold): the resume gives the clean build.
    text.write_bytes(original)
    assert _run(build_shards, [*args, "--resume"], capsys)[0] == 0
    clean = tmp_path / "clean"
    assert _run(build_shards, [a if a != output else clean for a in args], capsys)[0] == 0
    assert files_of(output) == files_of(clean)
