"""export-to-hub: folders that current transformers (5.x) loads, checked in that transformers against txl_dist.

The folders are written here with txl_dist; tests/hub_worker.py then loads them in a subprocess of the pinned
transformers environment that `make test` prepares (.venv-hf, or TXL_HF_PYTHON), offline and without txl_dist
importable, and records losses, generations and token ids; the tests compare them with txl_dist's.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import treebank

from txl_dist.export import load_export_tokenizer, write_export
from txl_dist.inference import generate_ids
from txl_dist.model import TransformerXLLM, preset
from txl_dist.tokenizer import load_tokenizer, write_tokenizer_json

pytestmark = pytest.mark.hf

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "hub_worker.py"
# Absolute but not resolved: a virtual environment's python is a link that must stay inside the environment.
HF_PYTHON = Path(os.path.abspath(os.environ.get("TXL_HF_PYTHON", ROOT / ".venv-hf" / "bin" / "python")))
PINNED_TRANSFORMERS = "5.24.0"

# div_val 1 and 4; tied and untied projections; shared and per-layer position biases (untie_r).
CASES = {
    "div_val4_tied": dict(
        n_token=10000,
        d_embed=64,
        div_val=4,
        cutoffs=[2000, 6000],
        tie_weight=True,
        tie_projs=[False, True, True],
        untie_r=False,
        tokenizer="word",
    ),
    "div_val1_untied_untie_r": dict(
        n_token=2000,
        d_embed=24,
        div_val=1,
        cutoffs=[500, 1000],
        tie_weight=False,
        tie_projs=[False, False, False],
        untie_r=True,
        pre_lnorm=True,
        same_length=True,
        clamp_len=6,
        mem_len=10,
        tokenizer="bpe",
    ),
    "div_val1_tied_projs": dict(
        n_token=1000,
        d_embed=24,
        div_val=1,
        cutoffs=[200, 600],
        tie_weight=True,
        tie_projs=[False, True, True],
        untie_r=False,
    ),
    "div_val4_untied_untie_r": dict(
        n_token=1000,
        d_embed=64,
        div_val=4,
        cutoffs=[200, 600],
        tie_weight=False,
        tie_projs=[False, False, False],
        untie_r=True,
        mem_len=5,
    ),
}
SEGMENT = 8
NEW_TOKENS = 24
PROMPT_LENGTH = 2 * SEGMENT + 4  # the document separator, then random tokens: over two segments


def convert(*args: str, check: bool = True) -> tuple[int, str]:
    """launchers/convert.py in this process (its exit status and standard error)."""
    import contextlib
    import io

    from launchers.convert import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        status = main(list(args))
    if check and status != 0:
        raise AssertionError(f"convert.py {args[0]} failed:\n{stderr.getvalue()}")
    return status, stderr.getvalue()


def _model(name: str) -> TransformerXLLM:
    settings = {k: v for k, v in CASES[name].items() if k != "tokenizer"}
    settings = {
        "d_model": 32,
        "n_head": 2,
        "d_head": 16,
        "d_inner": 64,
        "tgt_len": SEGMENT,
        "mem_len": 12,
        "dropout": 0.1,
        "dropatt": 0.1,
        **settings,
    }
    torch.manual_seed(sum(map(ord, name)))
    model = TransformerXLLM(preset("tiny", **settings)).eval()
    with torch.no_grad():  # weights far from their initialisation, so that the next token has a clear winner
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.15)
    return model


def _txl_losses(model: TransformerXLLM, data: torch.Tensor) -> torch.Tensor:
    mems, losses = None, []
    with torch.no_grad():
        for s in range((data.shape[1] - 1) // SEGMENT):
            window = slice(s * SEGMENT, (s + 1) * SEGMENT)
            loss, mems = model(data[:, window], data[:, window.start + 1 : window.stop + 1], mems)
            losses.append(loss)
    return torch.stack(losses)


@pytest.fixture(scope="module")
def unigram_tokenizer(tmp_path_factory) -> Path:
    """A SentencePiece unigram model of PTB (with an end-of-document and a user-defined symbol)."""
    from data_tools import train_tokenizer

    directory = tmp_path_factory.mktemp("unigram")
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "sentencepiece",
                "--model-type",
                "unigram",
                "--vocab-size",
                "1000",
                "--input-sentence-size",
                "8000",
                "--eod-symbol",
                "<eod>",
                "--user-symbols",
                "<sep>",
                "--format",
                "ptb",
                "--output",
                str(directory),
                "--overwrite",
                "--no-progress",
            ]
        )
        == 0
    )
    return directory


def _sentencepiece_lines() -> list[str]:
    """PTB test lines plus text that exercises the normaliser: spacing, tabs, NFKC, characters outside the
    training text, user symbols, empty lines."""
    extra = [
        "  leading and   inner  spaces\tand a tab ",
        "naïve café ｆｕｌｌｗｉｄｔｈ １２３ Ａ",
        "日本語のテキスト",
        "x<sep>y a <sep> b <sep>",
        "literal </s> <s> <unk> pieces",
        "",
        "   ",
        "a\u2028b\u00a0c",
        "end.",
    ]
    return treebank.penn["test"].split("\n") + extra


@pytest.fixture(scope="module")
def hub(tmp_path_factory, ptb_word_tokenizer, ptb_sentencepiece_tokenizer, unigram_tokenizer):
    """(references computed with txl_dist, results of the worker in current transformers)."""
    require_hf_python()
    root = tmp_path_factory.mktemp("hub")
    tokenizer_dirs = {"word": ptb_word_tokenizer, "bpe": ptb_sentencepiece_tokenizer, "unigram": unigram_tokenizer}
    references: dict = {"models": {}, "tokenizers": {}}
    jobs: dict = {"models": [], "tokenizers": []}
    for name, case in CASES.items():
        model = _model(name)
        tokenizer_dir = tokenizer_dirs.get(case.get("tokenizer"))
        export = write_export(model, model.config, root / f"{name}_export", tokenizer_dir=tokenizer_dir)
        convert("export-to-hub", str(export), str(root / name))
        data = torch.randint(0, model.config.n_token, (2, 3 * SEGMENT + 1), generator=torch.Generator().manual_seed(5))
        prompt = torch.randint(
            0, model.config.n_token, (PROMPT_LENGTH - 1,), generator=torch.Generator().manual_seed(6)
        )
        prompt = [0] + prompt.tolist()
        reference = {
            "losses": _txl_losses(model, data),
            "greedy": generate_ids(model, prompt, NEW_TOKENS, greedy=True),
            "model": model,
        }
        job = {
            "name": name,
            "folder": str(root / name),
            "data": data.tolist(),
            "segment": SEGMENT,
            "prompt": prompt,
            "new_tokens": NEW_TOKENS,
        }
        if name == "div_val4_tied":
            # Left-padded batch: a prompt of three segments, one a position shorter (its segments then straddle
            # the batch's), and a short one padded by 15 positions.
            job["padded_prompts"] = [prompt, prompt[1:], prompt[-5:]]
            reference["padded_greedy"] = [
                generate_ids(model, p, NEW_TOKENS, greedy=True) for p in job["padded_prompts"]
            ]
            job["sample"] = True
        references["models"][name] = reference
        jobs["models"].append(job)

    tokenizer_jobs = {
        "word": (root / "div_val4_tied", ptb_word_tokenizer),
        "bpe": (root / "tok_bpe", ptb_sentencepiece_tokenizer),
        "unigram": (root / "tok_unigram", unigram_tokenizer),
    }
    for kind, (folder, directory) in tokenizer_jobs.items():
        tokenizer = load_tokenizer(directory)
        if kind != "word":
            _tokenizer_only_folder(folder, tokenizer, root)
        lines = treebank.penn["test"].split("\n") if kind == "word" else _sentencepiece_lines()
        document = treebank.penn["test"] if kind == "word" else "\n".join(_sentencepiece_lines()[-12:])
        jobs["tokenizers"].append({"name": kind, "folder": str(folder), "lines": lines, "document": document})
        references["tokenizers"][kind] = {
            "lines": tokenizer.encode_batch(lines),
            "document": [tokenizer.eod_id] + tokenizer.encode_document(document)[:-1],
            "decoded": tokenizer.decode_document(tokenizer.encode_document(document)[:-1]),
            "special": [tokenizer.eod_id] * 3,
        }

    return references, run_hub_worker(jobs, root)


def require_hf_python() -> None:
    """Skip (fail under CI) when the current-transformers environment is missing."""
    if not HF_PYTHON.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{HF_PYTHON}: missing; `make test` creates it (make hf-venv)")
        pytest.skip(f"{HF_PYTHON}: missing; run `make hf-venv` (or set TXL_HF_PYTHON)")


def run_hub_worker(jobs: dict, root: Path) -> dict:
    """tests/hub_worker.py on ``jobs`` in the current-transformers environment; its results."""
    jobs_path, results_path = root / "jobs.json", root / "results.pt"
    jobs_path.write_text(json.dumps(jobs), encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(root / "hf_home"), OMP_NUM_THREADS="1")
    # -I: isolated (no PYTHONPATH, no user site, no script folder on sys.path), from a folder without txl_dist.
    result = subprocess.run(
        [str(HF_PYTHON), "-I", str(WORKER), str(jobs_path), str(results_path)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    if result.returncode != 0:
        raise AssertionError(f"hub_worker.py failed:\n{result.stderr[-4000:]}")
    return torch.load(results_path, weights_only=True)


def _tokenizer_only_folder(folder: Path, tokenizer, root: Path) -> None:
    """The folder export-to-hub writes for a small model with this tokenizer (the vocabulary fixes n_token)."""
    model = TransformerXLLM(preset("tiny", n_token=tokenizer.vocab_size, cutoffs=[], div_val=1)).eval()
    export = write_export(model, model.config, root / f"{folder.name}_export", tokenizer_dir=tokenizer.directory)
    convert("export-to-hub", str(export), str(folder))


def test_the_worker_ran_the_pinned_transformers_offline_without_txl_dist(hub):
    _, results = hub
    assert results["transformers"] == PINNED_TRANSFORMERS
    assert results["txl_dist_importable"] is False


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_folder_loads_with_every_weight_and_its_ties(hub, name):
    _, results = hub
    result = results["models"][name]
    assert result["class"] == "TransformerXLForCausalLM" and result["config_class"] == "TransformerXLConfig"
    assert result["missing"] == [] and result["unexpected"] == [] and result["mismatched"] == []
    case = CASES[name]
    out_layers = len(case["cutoffs"]) + 1 if case["div_val"] > 1 else 1
    expected_ties = case["tie_weight"] * out_layers + sum(case["tie_projs"])
    assert len(result["ties"]) == expected_ties and all(result["ties"].values()), result["ties"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_token_losses_over_three_segments_with_the_memory_equal_txl_dist(hub, name):
    references, results = hub
    reference, result = references["models"][name]["losses"], results["models"][name]
    assert result["from_logits"].shape == reference.shape == (3, 2, SEGMENT)
    assert (result["from_logits"] - reference).abs().max().item() <= 1e-5
    # labels are shifted inside (transformers' convention): the last position of a segment has no label there.
    assert (result["from_labels"] - reference[..., :-1]).abs().max().item() <= 1e-5
    # loss: the mean of those per-token losses of each call (a scalar per segment).
    assert (result["mean_loss"] - reference[..., :-1].mean(dim=(1, 2))).abs().max().item() <= 1e-5
    # One call over the three segments reads them as three segments.
    assert (result["one_call"] - torch.cat(list(reference), dim=1)).abs().max().item() <= 1e-5
    assert result["memory_seen"] == 3 * SEGMENT
    assert result["memory_positions"] == min(references["models"][name]["model"].config.mem_len, 3 * SEGMENT)


@pytest.mark.parametrize("name", sorted(CASES))
def test_generate_greedy_equals_txl_dist_generate(hub, name):
    references, results = hub
    assert results["models"][name]["greedy"] == references["models"][name]["greedy"]
    # One forward over the prompt, then one forward of one token per new token: the memory is reused as the cache.
    new_tokens = len(references["models"][name]["greedy"])
    assert results["models"][name]["greedy_forward_lengths"] == [PROMPT_LENGTH] + [1] * (new_tokens - 1)


def test_left_padded_batch_generates_what_each_prompt_generates_alone(hub):
    references, results = hub
    result = results["models"]["div_val4_tied"]
    assert result["padded_logprob_diff"] <= 1e-5
    assert result["padded_greedy"] == references["models"]["div_val4_tied"]["padded_greedy"]


def test_sampling_with_a_seed_is_reproducible(hub):
    references, results = hub
    first, again, other = results["models"]["div_val4_tied"]["samples"]
    assert len(first) == NEW_TOKENS and first == again
    assert other != first and first != references["models"]["div_val4_tied"]["greedy"]
    assert len(results["models"]["div_val4_tied"]["beam_tokens"]) == 4


@pytest.mark.parametrize("kind", ["word", "bpe", "unigram"])
def test_autotokenizer_ids_equal_txl_dist_ids(hub, kind):
    references, results = hub
    reference, result = references["tokenizers"][kind], results["tokenizers"][kind]
    assert result["class"] == "TokenizersBackend"
    mismatches = [i for i, (a, b) in enumerate(zip(result["lines"], reference["lines"])) if a != b]
    assert len(result["lines"]) == len(reference["lines"]) and not mismatches, mismatches[:5]
    # A text is a document's start: the separator first, line breaks as end-of-sentence tokens.
    assert result["document"] == reference["document"]
    assert result["decoded"] == reference["decoded"]
    assert result["special"] == reference["special"]
    assert result["padded"][0][0] == 0 or result["padded"][1][0] == 0  # padding on the left


def test_the_modeling_files_import_torch_and_transformers_only():
    allowed = {"__future__", "math", "dataclasses", "torch", "transformers"}
    from txl_dist.convert.hub import MODELING_FILES

    for name in MODELING_FILES:
        tree = ast.parse((ROOT / "txl_dist" / "convert" / "hub_files" / name).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module] if node.level == 0 else []
                if node.level:
                    assert f"{node.module}.py" in MODELING_FILES, (name, node.module)
            else:
                continue
            assert all(module.split(".")[0] in allowed for module in modules), (name, modules)


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    model = _model("div_val1_tied_projs")
    export = write_export(model, model.config, tmp_path / "export")
    config = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**config, "d_inner": config["d_inner"] + 1}))
    status, stderr = convert("export-to-hub", str(export), str(tmp_path / "hub"), check=False)
    assert status == 2 and "config.json: " in stderr and "checksums.json records" in stderr  # edited: not verified
    status, stderr = convert("export-to-hub", str(export), str(tmp_path / "hub"), "--no-verify", check=False)
    assert status == 2 and "layers.0.pos_ff.CoreNet.0.weight has shape" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_output_that_is_or_holds_the_input_is_refused(tmp_path):
    model = _model("div_val1_tied_projs")
    export = write_export(model, model.config, tmp_path / "export")
    before = sorted(p.name for p in export.iterdir())
    for output, why in (
        (export, "is the input"),
        (export / "hub", "inside the input"),
        (tmp_path, "contains the input"),
    ):
        status, stderr = convert("export-to-hub", str(export), str(output), "--overwrite", check=False)
        assert status == 2 and why in stderr, stderr
    assert sorted(p.name for p in export.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_tokenizer_the_fast_format_cannot_express_is_a_clear_error(tmp_path):
    """A SentencePiece model of type char (and one with byte fallback) has no fast-tokenizer form."""
    import io

    import sentencepiece

    lines = [line for line in treebank.penn["train"].split("\n")[:3000] if line.strip()]
    for name, settings in (("char", dict(model_type="char")), ("bytes", dict(model_type="bpe", byte_fallback=True))):
        directory = tmp_path / name
        directory.mkdir()
        buffer = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buffer, vocab_size=300, minloglevel=2, **settings
        )
        (directory / "spm.model").write_bytes(buffer.getvalue())
        processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "spm.model"))
        pieces = {
            key: processor.id_to_piece(i)
            for key, i in (("eos", processor.eos_id()), ("eod", processor.eos_id()), ("unk", processor.unk_id()))
        }
        tokenizer = write_tokenizer_json(
            directory,
            "sentencepiece",
            ["spm.model"],
            processor.get_piece_size(),
            processor.eos_id(),
            processor.eos_id(),
            processor.unk_id(),
            pieces,
            {},
        )
        model = TransformerXLLM(preset("tiny", n_token=tokenizer.vocab_size, cutoffs=[], div_val=1))
        export = write_export(model, model.config, tmp_path / f"{name}_export", tokenizer_dir=directory)
        assert load_export_tokenizer(export) is not None
        status, stderr = convert("export-to-hub", str(export), str(tmp_path / f"{name}_hub"), check=False)
        expected = "model type 'char'" if name == "char" else "byte_fallback=true"
        assert status == 2 and "spm.model: cannot be expressed as a fast tokenizer" in stderr
        assert expected in stderr, stderr
        assert not (tmp_path / f"{name}_hub").exists()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_an_existing_output_is_kept_unless_overwrite(tmp_path):
    model = _model("div_val1_tied_projs")
    export = write_export(model, model.config, tmp_path / "export")
    convert("export-to-hub", str(export), str(tmp_path / "hub"))
    status, stderr = convert("export-to-hub", str(export), str(tmp_path / "hub"), check=False)
    assert status == 2 and "already exists" in stderr
    (tmp_path / "hub" / "marker").write_text("old")
    convert("export-to-hub", str(export), str(tmp_path / "hub"), "--overwrite")
    assert not (tmp_path / "hub" / "marker").exists()
    shutil.rmtree(tmp_path / "hub")
