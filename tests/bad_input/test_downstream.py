"""Bad input to launchers/generate.py and launchers/evaluate.py (txl_dist.downstream): their arguments, evaluate's
output and what it reports for each kind of tokenizer, and signals.

The launchers run in this process where the subject is what they do with a signal (a real one, sent to this
process once they are at work), so that no test pays for another start of torch; the one test of the launcher
chain runs a real ``deepspeed --num_gpus 2``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time

import psutil
import pytest
import torch

from data_tools import build_shards
from tests.bad_input.helpers import _last_line_only, _one_line, _signalled_in_process
from tests.conftest import ptb_sentences
from tests.launcher import in_process, launcher_command, rank_processes, start
from txl_dist.export import write_export
from txl_dist.model import TransformerXLLM, preset
from txl_dist.tokenizer import load_tokenizer

# ---- generate.py: its arguments and the prompt -----------------------------------------------------------------------


def test_generate_refuses_zero_samples(ptb_export):
    _one_line(
        in_process("launchers/generate.py", str(ptb_export), "--prompt", "the", "--num-samples", "0", check=False),
        "--num-samples 0",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without CUDA")
def test_generate_on_cuda_without_cuda_is_one_line(ptb_export):
    _one_line(
        in_process("launchers/generate.py", str(ptb_export), "--prompt", "the", "--device", "cuda", check=False),
        "--device cuda",
        "no CUDA device",
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
        (["--top-p", "nan"], "top_p=nan must be in (0, 1]"),
        (["--temperature", "-1"], "temperature=-1.0 must be > 0"),
        (["--top-k", "-2"], "top_k=-2 must be an integer >= 0"),
    ],
)
def test_bad_sampling_settings_are_refused_before_the_prompt_is_echoed(ptb_export, flags, named):
    """The refusal once came glued to the echoed prompt ("thegenerate.py: error: ...")."""
    result = in_process("launchers/generate.py", str(ptb_export), "--prompt", "the", *flags, check=False)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("generate.py: error: ") and named in result.stderr
    _one_line(result, named)


def test_a_prompt_of_unknown_words_gets_a_warning(ptb_export):
    result = in_process(
        "launchers/generate.py", str(ptb_export), "--prompt", "zqxv wvvqz", "--greedy", "--max-new-tokens", "2"
    )
    assert "warning: 2 of the 2 tokens of the prompt 'zqxv wvvqz' are the unknown token" in result.stderr
    result = in_process(
        "launchers/generate.py", str(ptb_export), "--prompt", "the company", "--greedy", "--max-new-tokens", "2"
    )
    assert "unknown" not in result.stderr


# ---- evaluate.py: its arguments, its output and what it reports ------------------------------------------------------


def test_evaluate_refuses_batch_size_zero(ptb_export, small_shards):
    _one_line(
        in_process(
            "launchers/evaluate.py", str(ptb_export), "--shards", str(small_shards), "--batch-size", "0", check=False
        ),
        "--batch-size 0",
    )


@pytest.mark.parametrize("kind", ["dangling link", "folder", "no parent"])
def test_an_evaluate_output_it_cannot_write_is_refused_before_the_evaluation(tmp_path, capsys, kind):
    from launchers import evaluate

    output = {"dangling link": tmp_path / "eval.json", "folder": tmp_path, "no parent": tmp_path / "a" / "e.json"}
    if kind == "dangling link":  # the atomic write would replace the link, and the target stay missing
        output[kind].symlink_to(tmp_path / "gone.json")
    # The model does not exist: the output is refused before it is looked for.
    assert evaluate.main([str(tmp_path / "no_model"), "--output", str(output[kind])]) == 2
    assert capsys.readouterr().err.startswith(f"evaluate.py: error: --output {output[kind]}: ")


def test_evaluate_writes_no_nan_when_finite_weights_overflow(ptb_word_tokenizer, small_shards, tmp_path):
    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset
    from txl_dist.tokenizer import load_tokenizer

    model = TransformerXLLM(preset("tiny", n_token=load_tokenizer(ptb_word_tokenizer).vocab_size, cutoffs=[2000, 6000]))
    with torch.no_grad():
        model.layers[0].dec_attn.qkv_net.weight.fill_(1e30)  # finite, but the attention scores overflow to inf
    export = write_export(model, model.config, tmp_path / "export", tokenizer_dir=ptb_word_tokenizer)
    result = in_process(
        "launchers/evaluate.py", str(export), "--shards", str(small_shards), "--no-progress", check=False
    )
    _one_line(result, "the loss on split 'test'", "is nan, with finite weights", "no result written")
    assert not list(export.glob("eval_*.json"))


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


# ---- signals: Ctrl-C and SIGTERM to evaluate.py and generate.py, SIGTERM to the deepspeed runner ---------------------


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
