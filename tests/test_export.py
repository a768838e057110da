"""The export folder: config.json in the authors' names, safetensors with ties, tokenizer files, clear errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import txl_dist
from txl_dist.export import (
    AUTHORS_FIELDS,
    EXTRA_FIELDS,
    load_export_tokenizer,
    load_model,
    read_config_file,
    read_export_config,
    write_export,
)
from txl_dist.model import ModelConfig, TransformerXLLM, preset
from txl_dist.output_folders import OUTPUT_MARKER, OutputPathError

CASES = {
    "tied_div_val2": dict(div_val=2, d_embed=16, cutoffs=[200, 600]),
    "tied_div_val1_projected": dict(div_val=1, d_embed=12, cutoffs=[200, 600]),
    "untied": dict(div_val=2, d_embed=16, cutoffs=[200, 600], tie_weight=False, tie_projs=[False] * 3),
    "untie_r_full_softmax": dict(div_val=1, d_embed=16, cutoffs=[], untie_r=True),
}


def _model(case: str = "tied_div_val2", **overrides) -> TransformerXLLM:
    torch.manual_seed(0)
    model = TransformerXLLM(preset("tiny", **{**CASES[case], **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _resolved(config: ModelConfig) -> ModelConfig:
    """The config as an export writes it: d_embed and tie_projs spelled out."""
    return dataclasses.replace(config, d_embed=config.d_embed_resolved, tie_projs=config.tie_projs_resolved)


def _losses(model: TransformerXLLM, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, model.config.n_token, (2, 3 * 8 + 1), generator=g)
    mems, losses = None, []
    with torch.no_grad():
        for s in range(3):
            loss, mems = model(data[:, s * 8 : (s + 1) * 8], data[:, s * 8 + 1 : (s + 1) * 8 + 1], mems)
            losses.append(loss)
    return losses


def _word_tokenizer(directory: Path, n_token: int, first_word: str = "w") -> Path:
    """A tokenizer directory in txl_dist's layout: vocab.txt and tokenizer.json with the sha256 fingerprint."""
    directory.mkdir(parents=True)
    words = ["<unk>", "<eos>"] + [f"{first_word}{i}" for i in range(n_token - 2)]
    (directory / "vocab.txt").write_text(
        "".join(f"{w}\t{n_token - i}\n" for i, w in enumerate(words)), encoding="utf-8"
    )
    fingerprint = hashlib.sha256((directory / "vocab.txt").read_bytes()).hexdigest()
    description = {
        "kind": "word",
        "vocab_size": n_token,
        "files": ["vocab.txt"],
        "fingerprint": fingerprint,
        "eos_id": 1,
        "eod_id": 1,
        "unk_id": 0,
        "pieces": {"eos": "<eos>", "eod": "<eos>", "unk": "<unk>"},
        "training": {},
    }
    (directory / "tokenizer.json").write_text(json.dumps(description), encoding="utf-8")
    return directory


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_round_trip_gives_the_same_model(case, tmp_path):
    model = _model(case)
    out = write_export(model, model.config, tmp_path / "export", training_info={"step": 12, "tokens_seen": 3456})
    assert sorted(p.name for p in out.iterdir()) == [
        OUTPUT_MARKER,
        "checksums.json",
        "config.json",
        "model.safetensors",
        "training.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging folder left behind
    loaded = load_model(out)
    assert not loaded.training
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert sorted(state) == sorted(loaded_state)
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)
    for a, b in zip(_losses(model), _losses(loaded)):
        assert torch.equal(a, b)
    # Ties are ties again, not copies.
    for out_layer, emb_layer in zip(loaded.crit.out_layers, loaded.word_emb.emb_layers):
        assert (out_layer.weight is emb_layer.weight) == model.config.tie_weight
    assert loaded.num_parameters() == model.num_parameters()
    assert json.loads((out / "training.json").read_text()) == {"step": 12, "tokens_seen": 3456}


def test_tied_tensors_are_stored_once(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    model = _model("tied_div_val2")
    out = write_export(model, model.config, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        tied = json.loads(handle.metadata()["txl_dist.tied"])
    assert not any(k.startswith("crit.out_layers.") and k.endswith(".weight") for k in keys)
    assert tied["crit.out_layers.1.weight"] == "word_emb.emb_layers.1.weight"
    assert tied["crit.out_projs.2"] == "word_emb.emb_projs.2" and "crit.out_projs.0" not in tied
    assert "crit.out_projs.0" in keys
    stored = load_file(str(out / "model.safetensors"))
    assert sum(t.numel() for t in stored.values()) == model.num_parameters()


def test_config_json_uses_the_authors_names(tmp_path):
    model = _model("tied_div_val1_projected", clamp_len=7)
    out = write_export(model, model.config, tmp_path / "export")
    data = json.loads((out / "config.json").read_text())
    assert data["format"] == "txl_dist.export" and data["version"] == 1
    assert set(data) == set(AUTHORS_FIELDS) | set(EXTRA_FIELDS) | {"format", "version", "tokenizer"}
    assert data["d_embed"] == 12 and data["tie_projs"] == [False, True, True] and data["clamp_len"] == 7
    assert data["tokenizer"] is None
    assert read_export_config(out) == _resolved(model.config)


def test_a_config_with_only_the_authors_names_reads_with_defaults(tmp_path):
    authors = {
        "n_token": 1000,
        "n_layer": 2,
        "n_head": 2,
        "d_model": 16,
        "d_head": 8,
        "d_inner": 32,
        "d_embed": -1,
        "div_val": 1,
        "cutoffs": [200, 600],
        "tie_weight": True,
        "tie_projs": [False, True, True],
        "untie_r": False,
        "pre_lnorm": False,
        "tgt_len": 8,
        "mem_len": 8,
        "clamp_len": -1,
        "same_length": False,
        "dropout": 0.0,
        "dropatt": 0.0,
    }
    path = tmp_path / "authors.json"
    path.write_text(json.dumps(authors))
    config, tokenizer = read_config_file(path)
    assert tokenizer is None
    assert config.d_embed_resolved == 16 and config.layer_norm_eps == ModelConfig().layer_norm_eps
    del authors["n_head"]
    path.write_text(json.dumps(authors))
    with pytest.raises(ValueError, match=r"authors.json: missing key\(s\) \['n_head'\]"):
        read_config_file(path)
    path.write_text(json.dumps({**authors, "n_head": 2, "n_heads": 2}))
    with pytest.raises(ValueError, match="unknown key.*n_heads"):
        read_config_file(path)


def test_a_state_dict_without_tied_aliases_is_accepted_and_a_broken_tie_refused(tmp_path):
    model = _model("tied_div_val2")
    # What DeepSpeed's consolidation gives: each parameter once, under its first name.
    deduplicated = dict(model.named_parameters())
    assert "crit.out_layers.0.weight" not in deduplicated
    out = write_export(deduplicated, model.config, tmp_path / "export")
    assert torch.equal(load_model(out).crit.out_layers[0].weight, model.word_emb.emb_layers[0].weight)
    broken = {k: v.clone() for k, v in model.state_dict().items()}
    broken["crit.out_layers.1.weight"] += 1
    with pytest.raises(ValueError, match="crit.out_layers.1.weight differs from word_emb.emb_layers.1.weight"):
        write_export(broken, model.config, tmp_path / "broken")
    assert not (tmp_path / "broken").exists()


def test_weights_that_do_not_match_the_config_are_named(tmp_path):
    model = _model("tied_div_val2")
    state = model.state_dict()
    with pytest.raises(ValueError, match=r"missing \['layers.1.pos_ff.CoreNet.0.bias'\]"):
        write_export(
            {k: v for k, v in state.items() if k != "layers.1.pos_ff.CoreNet.0.bias"}, model.config, tmp_path / "a"
        )
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        write_export({**state, "extra.weight": torch.zeros(1)}, model.config, tmp_path / "b")
    out = write_export(model, model.config, tmp_path / "export")
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, "d_inner": 48}))
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: layers.0.pos_ff.CoreNet.0.weight has shape \[32, 16\], "
        r"but the configuration gives \[48, 16\]",
    ):
        load_model(out, verify=False)
    (out / "config.json").write_text(json.dumps({**data, "tie_weight": False}))
    with pytest.raises(ValueError, match="stored with the ties"):
        load_model(out, verify=False)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_config_files_of_another_format_version_or_tokenizer_record_are_refused(tmp_path):
    model = _model()
    out = write_export(model, model.config, tmp_path / "export")
    path = out / "config.json"
    written = json.loads(path.read_text())
    for changes, message in (
        ({"format": "txl_dist.checkpoint"}, "key 'format' is 'txl_dist.checkpoint', expected 'txl_dist.export'"),
        ({"version": 2}, "key 'version' is 2; this txl_dist reads version 1"),
        ({"tokenizer": "vocab.txt"}, "key 'tokenizer' must be null or an object with the keys"),
        (
            {"tokenizer": {"kind": "word", "vocab_size": 1000}},
            "key 'tokenizer' must be null or an object with the keys",
        ),
    ):
        path.write_text(json.dumps({**written, **changes}))
        with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
            load_model(out, verify=False)
    incomplete = {k: v for k, v in written.items() if k not in ("n_head", "dropatt")}
    path.write_text(json.dumps(incomplete))
    with pytest.raises(ValueError, match=r"missing key\(s\) \['n_head', 'dropatt'\]"):
        read_config_file(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_config_file(path)
    path.write_text('{"n_token": ')
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        read_config_file(path)


def test_missing_files_are_named(tmp_path):
    model = _model()
    out = write_export(model, model.config, tmp_path / "export")
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors: missing"):
        load_model(out, verify=False)
    (out / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json: missing"):
        load_model(out, verify=False)


def test_an_existing_folder_is_kept_unless_overwrite(tmp_path):
    model = _model()
    out = write_export(model, model.config, tmp_path / "export")
    other = _model("untied")
    with pytest.raises(OutputPathError, match="export: already exists"):
        write_export(other, other.config, out)
    assert read_export_config(out) == _resolved(model.config)
    write_export(other, other.config, out, overwrite=True)
    assert read_export_config(out) == _resolved(other.config)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_overrides_are_evaluation_settings_only(tmp_path):
    model = _model()
    out = write_export(model, model.config, tmp_path / "export")
    loaded = load_model(out, mem_len=20, clamp_len=5, same_length=True, tgt_len=4, attn_impl="fused", dropout=None)
    assert (loaded.config.mem_len, loaded.config.clamp_len, loaded.config.same_length, loaded.config.tgt_len) == (
        20,
        5,
        True,
        4,
    )
    with pytest.raises(ValueError, match="n_layer cannot be overridden"):
        load_model(out, n_layer=3)
    with pytest.raises(ValueError, match="layer_norm_eps cannot be overridden"):
        load_model(out, layer_norm_eps=1e-6)
    with pytest.raises(ValueError, match="unknown setting 'memlen'"):
        load_model(out, memlen=3)
    with pytest.raises(ValueError, match="model.mem_len=-1"):
        load_model(out, mem_len=-1)


def test_tokenizer_files_travel_and_must_match(tmp_path):
    model = _model()
    tokenizer_dir = _word_tokenizer(tmp_path / "tok", model.config.n_token)
    out = write_export(model, model.config, tmp_path / "export", tokenizer_dir=tokenizer_dir)
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["tokenizer.json", "vocab.txt"]
    recorded = json.loads((out / "config.json").read_text())["tokenizer"]
    fingerprint = hashlib.sha256((tokenizer_dir / "vocab.txt").read_bytes()).hexdigest()
    assert recorded == {
        "kind": "word",
        "vocab_size": 1000,
        "fingerprint": fingerprint,
        "eos_id": 1,
        "eod_id": 1,
        "unk_id": 0,
    }
    # Another (self-consistent) tokenizer put in the folder: both fingerprints are named.
    other_dir = _word_tokenizer(tmp_path / "other", model.config.n_token, first_word="v")
    other_fingerprint = json.loads((other_dir / "tokenizer.json").read_text())["fingerprint"]
    for name in ("vocab.txt", "tokenizer.json"):
        (out / "tokenizer" / name).write_bytes((other_dir / name).read_bytes())
    with pytest.raises(ValueError, match=f"records fingerprint {fingerprint}.*has fingerprint {other_fingerprint}"):
        load_export_tokenizer(out)
    # A damaged copy: the files no longer hash to what tokenizer.json says.
    (out / "tokenizer" / "vocab.txt").write_text("<unk>\t1\n")
    with pytest.raises(ValueError, match=f"vocab.txt'\\] have fingerprint .* records {other_fingerprint}"):
        load_export_tokenizer(out)
    (out / "tokenizer" / "vocab.txt").unlink()
    with pytest.raises(FileNotFoundError, match="vocab.txt: missing tokenizer file"):
        load_export_tokenizer(out)


def test_tokenizer_that_does_not_fit_the_model_is_refused(tmp_path):
    model = _model()
    small = _word_tokenizer(tmp_path / "small", 500)
    with pytest.raises(ValueError, match="vocab_size=500, but the model has n_token=1000"):
        write_export(model, model.config, tmp_path / "a", tokenizer_dir=small)
    tokenizer_dir = _word_tokenizer(tmp_path / "tok", 1000)
    identity = {
        k: v
        for k, v in json.loads((tokenizer_dir / "tokenizer.json").read_text()).items()
        if k in ("kind", "vocab_size", "fingerprint", "eos_id", "eod_id", "unk_id")
    }
    with pytest.raises(ValueError, match="the checkpoint records eos_id=2"):
        write_export(
            model,
            model.config,
            tmp_path / "b",
            tokenizer_dir=tokenizer_dir,
            tokenizer_identity={**identity, "eos_id": 2},
        )
    # An identity recorded without the files: the model loads, the tokenizer is reported missing.
    out = write_export(model, model.config, tmp_path / "c", tokenizer_identity=identity)
    load_model(out)
    with pytest.raises(FileNotFoundError, match="tokenizer: missing, but .*config.json records a tokenizer"):
        load_export_tokenizer(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "small", "tok"]


def test_load_pretrained(tmp_path):
    model = _model()
    out = write_export(model, model.config, tmp_path / "export")
    loaded, tokenizer = txl_dist.load_pretrained(out, mem_len=12)
    assert tokenizer is None and loaded.config.mem_len == 12
    from txl_dist.tokenizer import Tokenizer

    with_tokenizer = write_export(
        model, model.config, tmp_path / "with", tokenizer_dir=_word_tokenizer(tmp_path / "tok", model.config.n_token)
    )
    loaded, tokenizer = txl_dist.load_pretrained(with_tokenizer)
    assert isinstance(tokenizer, Tokenizer) and tokenizer.encode("w5 w7") == [7, 9]


def test_import_txl_dist_does_not_import_torch():
    code = (
        "import sys, txl_dist; assert 'torch' not in sys.modules; print(txl_dist.load_pretrained.__doc__ is not None)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"
