"""Conversion inputs: folders written by transformers 4.37.2's own save_pretrained, and what the converters refuse
(HuggingFace configs and weights they cannot express, paths that are not a training checkpoint)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from launchers import convert
from txl_dist.convert.hf import from_hf_config, from_hf_state_dict, read_hf_folder, to_hf_config
from txl_dist.convert.zero import CheckpointError, locate_checkpoint, read_training_checkpoint
from txl_dist.export import load_model
from txl_dist.model import preset

# Small sizes, everything else TransfoXLConfig's defaults: div_val 4, tie_projs [False, True, True] (written by
# save_pretrained; the constructor's proj_share_all_but_first), untie_r, same_length, clamp_len 1000,
# mem_len 1600, tied word embeddings.
HF_SMALL = dict(vocab_size=1000, cutoffs=[200, 600], d_model=32, d_embed=32, n_head=2, d_head=16, d_inner=64, n_layer=2)
HF_FOLDERS = {
    "defaults_pytorch_model_bin": (dict(), False),
    "defaults_safetensors": (dict(), True),
    "shared_position_biases": (dict(untie_r=False), True),
    "shared_position_biases_pytorch_model_bin": (dict(untie_r=False), False),
    "untied_projections_div_val2": (dict(proj_share_all_but_first=False, div_val=2), True),
    "untied_word_embeddings": (dict(tie_word_embeddings=False), True),
    "pre_lnorm_no_clamp_full_length": (dict(pre_lnorm=True, clamp_len=-1, same_length=False, mem_len=5), True),
}


def _hf_model(**changes):
    from transformers.models.deprecated.transfo_xl import TransfoXLConfig, TransfoXLLMHeadModel

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransfoXLLMHeadModel(TransfoXLConfig(**{**HF_SMALL, **changes})).eval()
    with torch.no_grad():  # away from the initial values, so that a weight read into the wrong place shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _hf_losses(model, data: torch.Tensor, tgt_len: int) -> list[torch.Tensor]:
    model.crit.keep_order = True  # otherwise HuggingFace returns the losses grouped by cluster
    mems, losses = [torch.empty(0, data.shape[0], model.config.d_model)] * model.config.n_layer, []
    with torch.no_grad():
        for start in range(0, data.shape[1] - 1, tgt_len):
            inputs, targets = data[:, start : start + tgt_len], data[:, start + 1 : start + tgt_len + 1]
            labels = torch.cat([targets[:, :1], targets], 1)[:, :-1]  # HuggingFace shifts labels by one
            out = model(input_ids=inputs, labels=labels, mems=mems)
            mems = out.mems
            losses.append(out.losses)
    return losses


@pytest.mark.parametrize("case", sorted(HF_FOLDERS))
def test_a_folder_saved_by_transformers_converts_to_the_same_model(case, tmp_path, capsys):
    """save_pretrained drops tied tensors from safetensors files (and keeps them in pytorch_model.bin), writes
    tie_projs instead of proj_share_all_but_first, and HuggingFace's defaults where nothing was set: the export
    gives HuggingFace's per-token losses over three segments with the memory."""
    changes, safe = HF_FOLDERS[case]
    hf = _hf_model(**changes)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=safe)
    assert (tmp_path / "hf" / ("model.safetensors" if safe else "pytorch_model.bin")).is_file()
    assert convert.main(["hf-to-export", str(tmp_path / "hf"), str(tmp_path / "export")]) == 0
    assert f"-> {tmp_path / 'export'}" in capsys.readouterr().out
    ours = load_model(tmp_path / "export")
    hf_config = hf.config
    assert (
        ours.config.div_val,
        ours.config.untie_r,
        ours.config.pre_lnorm,
        ours.config.same_length,
        ours.config.clamp_len,
        ours.config.mem_len,
        ours.config.tie_weight,
    ) == (
        hf_config.div_val,
        hf_config.untie_r,
        hf_config.pre_lnorm,
        hf_config.same_length,
        hf_config.clamp_len,
        hf_config.mem_len,
        hf_config.tie_word_embeddings,
    )
    assert ours.config.tie_projs_resolved == list(hf_config.tie_projs)
    tgt_len = 6
    data = torch.randint(0, HF_SMALL["vocab_size"], (3, 3 * tgt_len + 1), generator=torch.Generator().manual_seed(1))
    mems = None
    for segment, hf_loss in enumerate(_hf_losses(hf, data, tgt_len)):
        window = slice(segment * tgt_len, (segment + 1) * tgt_len)
        with torch.no_grad():
            loss, mems = ours(data[:, window], data[:, window.start + 1 : window.stop + 1], mems)
        assert (loss[:, :-1] - hf_loss).abs().max().item() <= 1e-5, segment


def test_huggingface_settings_txl_dist_cannot_express_are_refused(tmp_path):
    config = to_hf_config(preset("tiny"))
    with pytest.raises(ValueError, match="attn_type=2 is not Transformer-XL's relative attention"):
        from_hf_config({**config, "attn_type": 2})
    with pytest.raises(ValueError, match="sample_softmax models are not supported"):
        from_hf_config({**config, "sample_softmax": 100})
    with pytest.raises(ValueError, match=r"model.tie_projs=\[True, False, True\] cannot be expressed in HuggingFace"):
        to_hf_config(preset("tiny", tie_projs=[True, False, True]))
    # A layer with its own position biases while the config shares them (untie_r false).
    shared = preset("tiny", untie_r=False)
    hf = _hf_model(untie_r=True, div_val=2, d_embed=16, d_model=16, d_head=8, d_inner=32, cutoffs=[200, 600])
    with pytest.raises(ValueError, match="layer 0 has its own r_w_bias but the config says untie_r=false"):
        from_hf_state_dict(hf.state_dict(), shared)


def test_folders_that_are_not_huggingface_transfo_xl_are_named(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=f"{folder / 'config.json'}: missing"):
        read_hf_folder(folder)
    hf = _hf_model()
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type is 'gpt2', expected 'transfo-xl'"):
        read_hf_folder(folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor pytorch_model.bin"):
        read_hf_folder(folder)
    # Through the command line: one line naming the folder, exit status 2, no output written.
    assert convert.main(["hf-to-export", str(folder), str(tmp_path / "export")]) == 2
    assert not (tmp_path / "export").exists()


# ---- locating a training checkpoint -------------------------------------------------------------------------------


def _fake_checkpoint(tag_dir: Path, world_size: int = 2) -> Path:
    """A checkpoint folder marked complete, with no files yet (conversion reads it with verify=False)."""
    tag_dir.mkdir(parents=True)
    (tag_dir / "COMPLETE.json").write_text(json.dumps({"step": 5, "world_size": world_size, "files": {}}))
    return tag_dir


def test_locating_a_checkpoint_names_what_is_missing(tmp_path):
    run = tmp_path / "run"
    tag_dir = _fake_checkpoint(run / "checkpoints" / "step00000005")
    (run / "checkpoints" / "latest").write_text("step00000005\n")
    # The run folder, its checkpoints/ folder and the checkpoint folder all mean the same checkpoint.
    assert locate_checkpoint(run) == locate_checkpoint(run / "checkpoints") == locate_checkpoint(tag_dir) == tag_dir

    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nowhere'}: no such file or directory"):
        locate_checkpoint(tmp_path / "nowhere")
    (run / "checkpoints" / "latest").write_text("step00000009\n")
    with pytest.raises(CheckpointError, match="latest names step00000009, which is not a complete checkpoint"):
        locate_checkpoint(run)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="a checkpoint folder without COMPLETE.json: its save did not finish"):
        locate_checkpoint(unfinished)
    for not_a_run in (tmp_path / "empty", tmp_path / "file.pt"):
        not_a_run.mkdir() if not_a_run.suffix == "" else not_a_run.write_bytes(b"x")
        with pytest.raises(
            CheckpointError, match=f"{not_a_run}: not a txl_dist run, checkpoints directory or checkpoint folder"
        ):
            locate_checkpoint(not_a_run)


def test_a_checkpoint_marked_complete_without_its_files_is_named(tmp_path):
    tag_dir = _fake_checkpoint(tmp_path / "step00000005")
    with pytest.raises(CheckpointError, match="rank00000.pt: missing from a checkpoint marked complete"):
        read_training_checkpoint(tag_dir, verify=False)
    (tag_dir / "txl_rank_states").mkdir()
    for rank in range(2):
        torch.save({}, tag_dir / "txl_rank_states" / f"rank{rank:05d}.pt")
    with pytest.raises(CheckpointError, match=r"no DeepSpeed model-state file \(\*model_states.pt\)"):
        read_training_checkpoint(tag_dir, verify=False)
    torch.save({"module": {}}, tag_dir / "mp_rank_00_model_states.pt")
    with pytest.raises(
        CheckpointError, match="mp_rank_00_model_states.pt: no 'txl_dist' client state; not written by txl_dist"
    ):
        read_training_checkpoint(tag_dir, verify=False)
    # Verified (the default), the same folder fails first on its COMPLETE.json, which lists no checksums.
    with pytest.raises(CheckpointError, match="fails verification and is not read: .*lists no file checksums"):
        read_training_checkpoint(tag_dir)
