"""Bad input, round three (issue 27), downstream: signals to the launchers, the hub tokenizers on every id and on
short inputs in current transformers, and what evaluate.py reports for each kind of tokenizer.

The launchers run in this process where the subject is what they do with a signal (a real one, sent to this
process once they are at work), so that no test pays for another start of torch; the one test of the launcher
chain runs a real ``deepspeed --num_gpus 2``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import json
import os
import random
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from data_tools import build_shards, train_tokenizer
from tests.conftest import ptb_sentences
from tests.launcher import in_process, launcher_command, rank_processes, start
from tests.test_hub_export import _tokenizer_only_folder, require_hf_python, run_hub_worker, unigram_tokenizer
from txl_dist.convert.fast_tokenizer import CHAR_OUTSIDE_ALPHABET
from txl_dist.export import write_export
from txl_dist.model import TransformerXLLM, preset
from txl_dist.tokenizer import ByteTokenizer, load_tokenizer

assert unigram_tokenizer  # a fixture of test_hub_export, used here too


@pytest.fixture(scope="module")
def character_models(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per kind (byte, char): a tokenizer of PTB valid's text, the shards of its first 50 sentences (split test)
    and of all of it (split valid, 400k characters), and an export of an untrained tiny model."""
    root = tmp_path_factory.mktemp("character_models")
    text = root / "valid.txt"
    text.write_text("".join(line + "\n" for line in ptb_sentences("valid")), encoding="utf-8")
    short = root / "short.txt"
    short.write_text("".join(line + "\n" for line in ptb_sentences("valid")[:50]), encoding="utf-8")
    models = {}
    for kind in ("byte", "char"):
        folder = root / kind
        assert (
            train_tokenizer.main(
                ["--kind", kind, "--input", str(text), "--output", str(folder / "tok"), "--no-progress"]
            )
            == 0
        )
        splits = ["--split", f"test={short}", "--split", f"valid={text}", "--no-progress"]
        assert build_shards.main(["--tokenizer", str(folder / "tok"), "--output", str(folder / "shards"), *splits]) == 0
        vocab_size = load_tokenizer(folder / "tok").vocab_size
        torch.manual_seed(0)
        model = TransformerXLLM(preset("tiny", n_token=vocab_size, cutoffs=[], div_val=1))
        write_export(model, model.config, folder / "export", tokenizer_dir=folder / "tok")
        models[kind] = {"tokenizer": folder / "tok", "shards": folder / "shards", "export": folder / "export"}
    return models


# ---- signals ---------------------------------------------------------------------------------------------------


class _SignalEscaped(Exception):
    """SIGTERM reached the test's handler: the launcher under test did not handle it."""


def _escaped(signum, frame):
    raise _SignalEscaped(signal.Signals(signum).name)


def _signalled_in_process(script: str, args: list[str], ready: Callable[[str, str], bool], signum: int = signal.SIGINT):
    """``script``'s main(args) in this process, sent a real ``signum`` as soon as ``ready(stdout, stderr)`` (what
    it has printed so far); (exit status, stdout, stderr)."""
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    out, err = io.StringIO(), io.StringIO()
    running, sent = threading.Event(), threading.Event()

    def send_when_ready() -> None:
        deadline = time.monotonic() + 120
        while running.is_set() and time.monotonic() < deadline:
            if ready(out.getvalue(), err.getvalue()):
                sent.set()
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.002)

    # A background job starts with SIGINT ignored, which this process may have inherited: Ctrl-C's own handler.
    # SIGTERM's default would end the test session: a handler that fails the test unless main() has its own.
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, _escaped),
    }
    running.set()
    sender = threading.Thread(target=send_when_ready, daemon=True)
    sender.start()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = module.main(args)
    except (KeyboardInterrupt, _SignalEscaped):  # a traceback for the user; here it would end the test session
        pytest.fail(f"{script}: the signal escaped main():\n{err.getvalue()[-2000:]}")
    finally:
        running.clear()
        sender.join()
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert sent.is_set(), f"{script} ended before it was ready to be interrupted:\n{err.getvalue()[-2000:]}"
    return status, out.getvalue(), err.getvalue()


def _last_line_only(stderr: str, line: str) -> None:
    """``stderr`` ends with ``line``, and holds no traceback (a progress bar may come before it)."""
    assert "Traceback" not in stderr and stderr.rstrip("\n").split("\n")[-1] == line, stderr[-2000:]


@pytest.mark.parametrize(
    "signum, status, what", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped by SIGTERM")]
)
def test_ctrl_c_or_sigterm_during_evaluate_is_one_line_and_128_plus_the_signal_and_writes_nothing(
    character_models, signum, status, what, tmp_path
):
    byte = character_models["byte"]
    output = tmp_path / "eval.json"
    args = [str(byte["export"]), "--shards", str(byte["shards"]), "--split", "valid", "--batch-size", "1"]
    ended, _, stderr = _signalled_in_process(
        "launchers/evaluate.py", [*args, "--output", str(output)], lambda out, err: "eval:" in err, signum
    )
    assert ended == status
    _last_line_only(stderr, f"evaluate.py: {what}; no result written")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_generate_is_one_line_and_status_130(character_models):
    prompt = "the company said"
    status, stdout, stderr = _signalled_in_process(
        "launchers/generate.py",
        [str(character_models["char"]["export"]), "--prompt", prompt, "--max-new-tokens", "1000000", "--seed", "1"],
        lambda out, err: len(out) > len(prompt) + 10,
    )
    assert status == 130 and stdout.startswith(prompt)
    _last_line_only(stderr, "generate.py: interrupted; what it generated or scored before is printed above")


def test_ctrl_c_during_convert_leaves_no_output_and_no_staging_folder(tmp_path):
    # 15M parameters: the weights take long enough to write that the interrupt lands while the folder is staged.
    torch.manual_seed(0)
    model = TransformerXLLM(preset("tiny", d_model=512, d_inner=2048, n_head=8, d_head=64, n_layer=4, d_embed=512))
    export = write_export(model, model.config, tmp_path / "export")
    output = tmp_path / "hub"
    status, _, stderr = _signalled_in_process(
        "launchers/convert.py",
        ["export-to-hub", str(export), str(output)],
        lambda out, err: any(path.name.startswith(".hub.") for path in tmp_path.iterdir()),
    )
    assert status == 130
    _last_line_only(stderr, "convert.py: interrupted; no output written (an existing one is left as it was)")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export"]


def _read_until(process: subprocess.Popen, needle: str, timeout: float) -> str:
    """What ``process`` printed until ``needle`` appeared (its output unbuffered: a progress bar has no line end)."""
    seen, deadline = b"", time.monotonic() + timeout
    while needle.encode() not in seen:
        assert time.monotonic() < deadline and process.poll() is None, seen.decode(errors="replace")[-3000:]
        if select.select([process.stdout], [], [], 1.0)[0]:
            seen += os.read(process.stdout.fileno(), 65536)
    return seen.decode(errors="replace")


@pytest.mark.launcher
def test_sigterm_to_the_deepspeed_runner_of_a_two_rank_evaluate_ends_its_launcher_and_ranks(character_models, tmp_path):
    """The runner has no handler: SIGTERM ends it alone, its per-node launcher is adopted by PID 1 and, before
    issue 27, both ranks went on scoring (for many minutes here). Each rank watches the runner, as training's do,
    and stops; DeepSpeed's launcher then ends, seeing a rank fail."""
    byte = character_models["byte"]
    output = tmp_path / "eval.json"
    job = start(
        launcher_command(
            "launchers/evaluate.py",
            [str(byte["export"]), "--shards", str(byte["shards"]), "--split", "valid", "--batch-size", "2"]
            + ["--output", str(output)],
        )
    )
    launch_and_ranks: list[psutil.Process] = []
    try:
        printed = _read_until(job, "eval:", timeout=400)  # rank 0's bar: both ranks are scoring
        launch_and_ranks = psutil.Process(job.pid).children(recursive=True)
        assert len(rank_processes(job)) == 2, launch_and_ranks
        assert any("deepspeed.launcher.launch" in " ".join(p.cmdline()) for p in launch_and_ranks), launch_and_ranks
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=30)
        _, alive = psutil.wait_procs(launch_and_ranks, timeout=30)
        assert not alive, f"still running 30 s after the runner went: {alive}"
    finally:  # a failing test leaves nothing running
        if job.poll() is None:
            launch_and_ranks += [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]
        for process in launch_and_ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    printed += job.stdout.read()
    assert f"evaluate.py: stopped: the deepspeed runner (PID {job.pid}) exited; no result written" in printed
    assert "Traceback" not in printed, printed[-3000:]
    assert list(tmp_path.iterdir()) == []


# ---- the hub tokenizers in current transformers ----------------------------------------------------------------

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


# ---- what evaluate.py reports ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["byte", "char"])
def test_evaluate_reports_bits_per_character_and_no_perplexity_for_character_tokenizers(
    character_models, kind, tmp_path
):
    model = character_models[kind]
    output = tmp_path / "eval.json"
    args = [str(model["export"]), "--shards", str(model["shards"]), "--no-progress", "--output", str(output)]
    result = in_process("launchers/evaluate.py", *args)
    summary = json.loads(output.read_text())
    assert summary["bits_per_character"] == pytest.approx(summary["loss"] / 0.6931471805599453, rel=1e-12)
    assert not {"ppl", "word_ppl", "words", "bits_per_token"} & set(summary), summary
    line = result.stdout.strip()
    assert "ppl" not in line and f"{summary['bits_per_character']:.4f} bits/char" in line, line
    assert result.stderr == ""  # --no-progress: no bar at all


def test_evaluate_reports_token_and_word_perplexity_for_word_tokenizers(ptb_word_tokenizer, tmp_path):
    sentences = ptb_sentences("valid")[:100]
    (tmp_path / "test.txt").write_text("".join(line + "\n" for line in sentences), encoding="utf-8")
    shards = tmp_path / "shards"
    args = ["--tokenizer", str(ptb_word_tokenizer), "--split", f"test={tmp_path / 'test.txt'}", "--no-progress"]
    assert build_shards.main([*args, "--output", str(shards)]) == 0
    torch.manual_seed(0)
    model = TransformerXLLM(preset("tiny", n_token=load_tokenizer(ptb_word_tokenizer).vocab_size, cutoffs=[2000]))
    export = write_export(model, model.config, tmp_path / "export", tokenizer_dir=ptb_word_tokenizer)
    result = in_process("launchers/evaluate.py", str(export), "--shards", str(shards), "--no-progress")
    summary = json.loads((export / "eval_test.json").read_text())
    assert summary["words"] == sum(len(line.split()) + 1 for line in sentences)
    assert summary["word_ppl"] == pytest.approx(summary["ppl"], rel=1e-9)  # every token a word
    assert "bits_per_character" not in summary
    assert f"ppl {summary['ppl']:.2f}, word ppl {summary['word_ppl']:.2f}" in result.stdout
