"""The authors' released TensorFlow models -> export folders (launchers/convert.py tf-to-export): folders laid out
as their download.sh makes them (tests/authors_release.py), read with TensorFlow's checkpoint reader, give the
per-token losses of transformers 4.37.2 holding the same checkpoint through its own TF loader; their vocabulary
becomes a tokenizer whose ids are theirs. Needs TensorFlow (the tf extra, which `make test` installs): the hf
tier."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from data_tools import build_shards
from launchers import convert
from tests.authors_release import hf_model, write_release
from tests.launcher import TRAIN, in_process, records, run, tiny_args
from txl_dist.export import load_model, load_pretrained

pytestmark = [pytest.mark.hf, pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")]


@pytest.fixture(autouse=True, scope="module")
def _tensorflow():
    """Skip (fail under CI) without TensorFlow."""
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("TensorFlow is missing: `make test` installs the tf extra (pip install -e '.[tf]')")
        pytest.skip("TensorFlow is missing: pip install -e '.[tf]'")


SMALL = dict(n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32)
WORD_SYMBOLS = ["<eos>", *(f"w{i}" for i in range(296)), "<unk>", "the", "The"]
WORD_CASES = {
    # WikiText-103's layout: div_val 4, every tail projection tied to the embedding's (proj_share_all_but_first)
    "div_val4_tied_tails_untie_r": dict(
        div_val=4, d_embed=64, cutoffs=[40, 120, 200], tie_projs=[False, True, True, True], untie_r=True
    ),
    "div_val2_untied_shared_r": dict(
        div_val=2, d_embed=16, cutoffs=[60, 180], tie_projs=[False, False, False], untie_r=False
    ),
    "div_val2_mixed_ties_shared_r": dict(div_val=2, d_embed=32, cutoffs=[100], tie_projs=[True, False], untie_r=False),
}
TGT_LEN, MEM_LEN = 6, 8


def _settings(case: dict, n_token: int, seed: int = 0) -> dict:
    return {**SMALL, **case, "n_token": n_token, "seed": seed}


def _convert(tmp_path, name: str, *extra: str) -> int:
    return convert.main(
        [
            "tf-to-export",
            str(tmp_path / name),
            str(tmp_path / f"{name}_export"),
            "--tgt-len",
            str(TGT_LEN),
            "--mem-len",
            str(MEM_LEN),
            "--clamp-len",
            "-1",
            "--no-same-length",
            *extra,
        ]
    )


def _losses_ours(model, data: torch.Tensor) -> torch.Tensor:
    losses, mems = [], None
    with torch.no_grad():
        for start in range(0, data.shape[1] - 1, TGT_LEN):
            inputs, targets = data[:, start : start + TGT_LEN], data[:, start + 1 : start + TGT_LEN + 1]
            loss, mems = model(inputs[:, : targets.shape[1]], targets, mems)
            losses.append(loss)
    return torch.cat(losses, 1)


def _losses_hf(model, data: torch.Tensor) -> torch.Tensor:
    """Per-token losses of the HuggingFace model, segment by segment with its memory, starting empty as ours."""
    mems, losses = [torch.empty(0, data.shape[0], model.config.d_model)] * model.config.n_layer, []
    with torch.no_grad():
        for start in range(0, data.shape[1] - 1, TGT_LEN):
            inputs, targets = data[:, start : start + TGT_LEN], data[:, start + 1 : start + TGT_LEN + 1]
            inputs = inputs[:, : targets.shape[1]]
            labels = torch.cat([targets[:, :1], targets], 1)[:, :-1]  # HuggingFace shifts the labels by one
            out = model(input_ids=inputs, labels=labels, mems=mems)
            mems = out.mems
            losses.append(torch.cat([out.losses, torch.zeros(inputs.shape[0], 1)], 1))
    # HuggingFace scores the last position of each segment against nothing: compare the positions it scores.
    return torch.cat(losses, 1)


def _compare(tmp_path, name: str, settings: dict, n_token: int) -> None:
    model = load_model(tmp_path / f"{name}_export")
    hf = hf_model(tmp_path / name / "model" / "model.ckpt-0", settings, TGT_LEN, MEM_LEN)
    data = torch.randint(0, n_token, (3, 3 * TGT_LEN + 1), generator=torch.Generator().manual_seed(5))
    ours, theirs = _losses_ours(model, data), _losses_hf(hf, data)
    scored = torch.ones_like(ours, dtype=torch.bool)
    scored[:, TGT_LEN - 1 :: TGT_LEN] = False  # the positions HuggingFace does not score (see _losses_hf)
    assert scored.sum() >= 2 * ours.numel() // 3
    assert torch.allclose(ours[scored], theirs[scored], atol=1e-5, rtol=0), (ours - theirs)[scored].abs().max()
    assert ours.mean() > 1.0  # a real score: random weights predict nothing


@pytest.mark.parametrize("case", sorted(WORD_CASES))
def test_word_model_gives_transformers_losses_of_the_same_tensorflow_checkpoint(case, tmp_path, capsys):
    settings = _settings(WORD_CASES[case], len(WORD_SYMBOLS))
    write_release(tmp_path / "tf_wt103", "wt103", WORD_SYMBOLS, settings, special=["<eos>"])
    assert _convert(tmp_path, "tf_wt103") == 0, capsys.readouterr().err
    assert "wt103: 2 layers" in capsys.readouterr().out
    model = load_model(tmp_path / "tf_wt103_export")
    config = model.config
    assert (config.div_val, config.cutoffs, config.tie_projs, config.untie_r) == (
        settings["div_val"],
        settings["cutoffs"],
        settings["tie_projs"],
        settings["untie_r"],
    )
    assert (config.layer_norm_eps, config.tie_weight, config.d_embed) == (1e-12, True, settings["d_embed"])
    _compare(tmp_path, "tf_wt103", settings, len(WORD_SYMBOLS))


def test_character_model_gives_transformers_losses_and_their_byte_ids(tmp_path, capsys):
    """enwik8's layout: div_val 1, a full softmax, their vocabulary of byte values in decimal ordered by
    frequency, newlines dropped; transformers' own TF loader cannot place a div_val-1 model's table, which
    the oracle places by the same rule (tests/authors_release.hf_model)."""
    symbols = [str(b) for b in (32, 101, 116, 97, 111, 10, 60, 62, 195, 169)]
    symbols = [s for s in symbols if s != "10"] + [str(b) for b in range(65, 91)]
    settings = _settings(dict(div_val=1, d_embed=16, cutoffs=[], tie_projs=[True], untie_r=False), len(symbols))
    write_release(tmp_path / "tf_enwik8", "enwik8", symbols, settings)
    assert _convert(tmp_path, "tf_enwik8") == 0, capsys.readouterr().err
    _compare(tmp_path, "tf_enwik8", settings, len(symbols))
    model, tokenizer = load_pretrained(tmp_path / "tf_enwik8_export")
    assert (tokenizer.kind, tokenizer.vocab_size) == ("byte", len(symbols))
    text = "été <tea>\nAte"
    their_ids = [symbols.index(str(b)) for b in text.encode("utf-8") if b != 10]  # their prep drops newlines
    assert tokenizer.encode(text) == their_ids
    assert tokenizer.decode(their_ids) == text.replace("\n", "")


def test_an_untied_char_model_with_a_projection_and_text8_characters(tmp_path, capsys):
    """text8's layout with d_embed != d_model (the embedding's proj_W), their '_' for the space."""
    symbols = ["_", *"etaoinshrdlcumwfgypbvkjxqz"]
    settings = _settings(dict(div_val=1, d_embed=12, cutoffs=[], tie_projs=[True], untie_r=True), len(symbols))
    write_release(tmp_path / "tf_text8", "text8", symbols, settings)
    assert _convert(tmp_path, "tf_text8") == 0, capsys.readouterr().err
    _compare(tmp_path, "tf_text8", settings, len(symbols))
    _, tokenizer = load_pretrained(tmp_path / "tf_text8_export")
    assert tokenizer.encode("the cat") == [symbols.index(c) for c in "the_cat"]
    assert tokenizer.encode_documents([["the cat", "sat"]])[0].tolist() == [
        *(symbols.index(c) for c in "the_catsat_")  # lines run together, the document ends with the space
    ]


def test_lm1b_layout_without_same_dim_projections_and_its_vocabulary(tmp_path, capsys):
    """One Billion Word's layout (proj_same_dim=False: the head cluster, of width d_model, has no projection;
    no projection tied) and vocabulary (<S> frames each sentence, <UNK>); checkpoint model.ckpt-1191000."""
    symbols = ["<S>", "</S>", "<UNK>", *(f"w{i}" for i in range(197)), "The", "the"]
    case = dict(div_val=4, d_embed=16, cutoffs=[50, 120], tie_projs=[False, False, False], untie_r=True)
    settings = {**_settings(case, len(symbols)), "proj_same_dim": False}
    write_release(tmp_path / "tf_lm1b", "lm1b", symbols, settings, unk_idx=2, step=1191000)
    assert _convert(tmp_path, "tf_lm1b") == 0, capsys.readouterr().err
    model, tokenizer = load_pretrained(tmp_path / "tf_lm1b_export")
    # Their transformer with no projection is ours with the identity.
    assert torch.equal(model.word_emb.emb_projs[0], torch.eye(16))
    tokens, lengths = tokenizer.encode_documents([["The w3 zebra"], ["the"]])
    S, unk = symbols.index("<S>"), symbols.index("<UNK>")
    assert tokens.tolist() == [S, symbols.index("The"), symbols.index("w3"), unk, S, S, symbols.index("the"), S]
    assert lengths.tolist() == [5, 3]
    training = json.loads((tmp_path / "tf_lm1b_export" / "training.json").read_text())
    assert training["converted_from"] == "tensorflow" and training["checkpoint"].endswith("model.ckpt-1191000")
    assert len(training["sha256"]) == 64


def test_release_settings_are_their_test_settings_unless_given(tmp_path, capsys):
    settings = _settings(WORD_CASES["div_val4_tied_tails_untie_r"], len(WORD_SYMBOLS))
    write_release(tmp_path / "tf_wt103", "wt103", WORD_SYMBOLS, settings, special=["<eos>"])
    out = tmp_path / "export"
    assert convert.main(["tf-to-export", str(tmp_path / "tf_wt103"), str(out)]) == 0, capsys.readouterr().err
    config = load_model(out).config
    # tf/sota/wt103.sh: TEST_TGT_LEN 128, TEST_MEM_LEN 1600, TEST_CLAMP_LEN 1000, same_length; dropout 0.2 of
    # tf/scripts/wt103_large_tpu.sh
    assert (config.tgt_len, config.mem_len, config.clamp_len, config.same_length) == (128, 1600, 1000, True)
    assert (config.dropout, config.dropatt) == (0.2, 0.2)


@pytest.mark.parametrize(
    "name",
    ["transformer/layer_1/ff/layer_2/bias", "transformer/adaptive_softmax/cutoff_2/b", "transformer/r_r_bias"],
)
def test_a_checkpoint_missing_a_variable_is_refused_in_one_line(name, tmp_path, capsys):
    settings = _settings(WORD_CASES["div_val4_tied_tails_untie_r"], len(WORD_SYMBOLS))
    write_release(tmp_path / "tf_wt103", "wt103", WORD_SYMBOLS, settings, special=["<eos>"], drop=(name,))
    assert _convert(tmp_path, "tf_wt103") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and repr(name) in err, err
    assert not (tmp_path / "tf_wt103_export").exists()


def _release_with_shards(tmp_path):
    """A wt103-layout release, its export, and shards of a text in its vocabulary built with the export's
    tokenizer (what docs/fine-tuning.md has a user do)."""
    settings = _settings(WORD_CASES["div_val4_tied_tails_untie_r"], len(WORD_SYMBOLS))
    write_release(tmp_path / "tf_wt103", "wt103", WORD_SYMBOLS, settings, special=["<eos>"])
    assert convert.main(["tf-to-export", str(tmp_path / "tf_wt103"), str(tmp_path / "export")]) == 0
    rng = torch.Generator().manual_seed(3)
    words = [WORD_SYMBOLS[1 + int(i)] for i in torch.randint(0, 40, (3000,), generator=rng)]
    lines = [" ".join(words[i : i + 15]) for i in range(0, len(words), 15)]
    for split, part in (("train", lines[:150]), ("valid", lines[150:])):
        (tmp_path / f"{split}.txt").write_text("".join(line + "\n" for line in part))
    flags = ["--split", f"train={tmp_path / 'train.txt'}", "--split", f"valid={tmp_path / 'valid.txt'}"]
    assert (
        build_shards.main(
            ["--tokenizer", str(tmp_path / "export"), "--output", str(tmp_path / "shards"), *flags, "--no-progress"]
        )
        == 0
    )
    return tmp_path / "tf_wt103", tmp_path / "export", tmp_path / "shards"


def test_a_run_starts_from_the_tensorflow_release_and_text_scores_with_it(tmp_path):
    """train.init_from names the release folder itself: the first step's loss is the converted model's on that
    batch; evaluate.py --text scores with the release as with its export."""
    release, export, shards = _release_with_shards(tmp_path)
    output = tmp_path / "run"
    args = tiny_args(
        shards,
        output,
        f"train.init_from={release}",
        "train.max_steps=1",
        "model.tgt_len=8",
        "model.mem_len=8",
        "model.same_length=false",
        "model.clamp_len=-1",
    )
    run(
        [sys.executable, TRAIN, *args[:1], "configs/finetune_cpu.yaml", *args[2:], "model.dropout=0", "model.dropatt=0"]
    )
    model = load_model(export, dropout=0.0, dropatt=0.0, tgt_len=8, mem_len=8, same_length=False, clamp_len=-1)
    from tests.test_init_from import _first_batch_loss

    expected = _first_batch_loss(model, shards, ["model.tgt_len=8"], config="configs/finetune_cpu.yaml")
    assert records(output)[1]["loss"] == pytest.approx(expected, rel=1e-5)
    assert records(output, "start")[0]["init_from"]["kind"] == "the authors' TensorFlow release"
    text = tmp_path / "valid.txt"
    by_release = in_process("launchers/evaluate.py", str(release), "--text", str(text), "--no-progress")
    by_export = in_process("launchers/evaluate.py", str(export), "--text", str(text), "--no-progress")
    last = [result.stdout.strip().splitlines()[-1] for result in (by_release, by_export)]
    assert last[0] == last[1] and "ppl" in last[0], last


def test_init_from_a_release_missing_a_variable_is_refused_in_one_line(tmp_path):
    release, _, shards = _release_with_shards(tmp_path)
    name = "transformer/layer_1/rel_attn/o/kernel"
    shutil.rmtree(release)
    settings = _settings(WORD_CASES["div_val4_tied_tails_untie_r"], len(WORD_SYMBOLS))
    write_release(release, "wt103", WORD_SYMBOLS, settings, special=["<eos>"], drop=(name,))
    result = in_process(
        "launchers/train.py",
        "--config",
        "configs/finetune_cpu.yaml",
        f"data.shards={shards}",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.init_from={release}",
        check=False,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if "warning" not in line.lower()]
    assert len(lines) == 1 and repr(name) in lines[0], result.stderr


def test_the_authors_vocabularies_export_to_current_transformers_with_their_ids(tmp_path):
    """export-to-hub of a model with each of the authors' vocabularies: AutoTokenizer gives txl_dist's ids (their
    ids), lower-casing, <S> framing and dropped line breaks included."""
    from tests.authors_release import write_cache
    from tests.test_hub_export import _tokenizer_only_folder, require_hf_python, run_hub_worker
    from txl_dist.convert.authors_vocab import read_cache, write_authors_tokenizer
    from txl_dist.tokenizer import load_tokenizer

    require_hf_python()
    text = "The cat sat on the mat .\nA zebra IS here\nthe end"
    words = ["the", "cat", "sat", "on", "mat", ".", "a", "is", "here", "end", "The", "A", "IS"]
    cases = {
        "wt103": (["<eos>", *words, "<unk>"], dict(special=["<eos>"])),
        "ptb": (["<eos>", *words[:10], "<unk>"], dict(special=["<eos>"], lower_case=True)),
        "lm1b": (["<S>", "</S>", "<UNK>", *words], dict(unk_idx=2)),
        "enwik8": ([str(b) for b in sorted(set(text.encode()) - {10})], {}),
        "text8": (["_", *sorted(set(text.lower()) - {" ", "\n", "."})], {}),
    }
    jobs, references = {"models": [], "tokenizers": []}, {}
    for dataset, (symbols, options) in cases.items():
        path = write_cache(tmp_path / f"{dataset}.pkl", dataset, symbols, **options)
        (tmp_path / f"tok_{dataset}").mkdir()
        write_authors_tokenizer(read_cache(path), dataset, tmp_path / f"tok_{dataset}")
        tokenizer = load_tokenizer(tmp_path / f"tok_{dataset}")
        document = text.lower().replace(".", "") if dataset == "text8" else text
        _tokenizer_only_folder(tmp_path / f"hub_{dataset}", tokenizer, tmp_path)
        lines = document.split("\n")
        jobs["tokenizers"].append(
            {"name": dataset, "folder": str(tmp_path / f"hub_{dataset}"), "lines": lines, "document": document}
        )
        references[dataset] = {
            "lines": tokenizer.encode_batch(lines),
            "document": [tokenizer.eod_id] + tokenizer.encode_document(document)[:-1],
            "decoded": tokenizer.decode_document(tokenizer.encode_document(document)[:-1]),
        }
    results = run_hub_worker(jobs, tmp_path)
    for dataset, reference in references.items():
        result = results["tokenizers"][dataset]
        for key in ("lines", "document", "decoded"):
            assert result[key] == reference[key], (dataset, key, result[key], reference[key])
