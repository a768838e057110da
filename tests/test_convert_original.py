"""Our weights <-> the authors' PyTorch state-dict layout (kimiyoung/transformer-xl, pytorch/)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from txl_dist.convert.original import (
    from_original_state_dict,
    load_original,
    save_original,
    to_original_state_dict,
)
from txl_dist.model import ModelConfig, TransformerXLLM, preset

CASES = {
    "div_val2_three_tails": dict(div_val=2, d_embed=16, cutoffs=[100, 300, 600]),
    "div_val1_projected": dict(div_val=1, d_embed=12, cutoffs=[200, 600]),
    "div_val1_unprojected_untied": dict(
        div_val=1, d_embed=16, cutoffs=[150, 400, 700], tie_weight=False, tie_projs=[False] * 4
    ),
    "div_val4_one_tail": dict(div_val=4, d_embed=32, cutoffs=[300]),
    "full_softmax": dict(div_val=1, d_embed=16, cutoffs=[]),
}


def _model(case: str, seed: int = 0) -> TransformerXLLM:
    config = preset("tiny", **CASES[case])
    torch.manual_seed(seed)
    model = TransformerXLLM(config).eval()
    with torch.no_grad():  # far from the initialisation, so that a misplaced row changes the result
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
        if model.crit.n_clusters:
            model.crit.cluster_bias.copy_(torch.linspace(-3, 3, model.crit.n_clusters))
    return model


def _authors_keys(config: ModelConfig) -> set[str]:
    """The state-dict keys of the authors' MemTransformerLM (attn_type 0), listed from their module layout."""
    n_clusters = len(config.cutoffs) + 1
    clusters = range(n_clusters)
    projected = config.div_val > 1 or config.d_embed_resolved != config.d_model
    keys = {"r_w_bias", "r_r_bias", "pos_emb.inv_freq"}
    if config.div_val == 1:
        keys |= {"word_emb.emb_layers.0.weight", "crit.out_layers.0.weight", "crit.out_layers.0.bias"}
        keys |= {"word_emb.emb_projs.0"} if projected else set()
    else:
        keys |= {f"word_emb.emb_layers.{i}.weight" for i in clusters} | {f"word_emb.emb_projs.{i}" for i in clusters}
        keys |= {f"crit.out_layers.{i}.{p}" for i in clusters for p in ("weight", "bias")}
    if projected:
        keys |= {f"crit.out_projs.{i}" for i in clusters}
    if config.cutoffs:
        keys |= {"crit.cluster_weight", "crit.cluster_bias"}
    for layer in range(config.n_layer):
        keys |= {f"layers.{layer}.dec_attn.{m}.weight" for m in ("qkv_net", "r_net", "o_net")}
        keys |= {
            f"layers.{layer}.{ln}.{p}"
            for ln in ("dec_attn.layer_norm", "pos_ff.layer_norm")
            for p in ("weight", "bias")
        }
        keys |= {f"layers.{layer}.pos_ff.CoreNet.{i}.{p}" for i in (0, 3) for p in ("weight", "bias")}
    return keys


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_exact_and_keys_are_the_authors(case):
    model = _model(case)
    state = model.state_dict()
    original = to_original_state_dict(state, model.config)
    assert set(original) == _authors_keys(model.config)
    expected_freq = 1.0 / 10000 ** (torch.arange(0, model.config.d_model, 2).double() / model.config.d_model)
    assert torch.allclose(original["pos_emb.inv_freq"].double(), expected_freq, rtol=1e-6)
    back = from_original_state_dict(original, model.config)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[key], state[key]) for key in state)
    TransformerXLLM(model.config).load_state_dict(back, strict=True)


def _authors_log_probs(state: dict[str, torch.Tensor], config: ModelConfig, hidden: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of every word by the authors' rule (pytorch/utils/proj_adaptive_softmax.py): the head
    scores the shortlist then the rows of cluster_weight, and tail cluster i is reached through head column -i."""
    ends = [0] + list(config.cutoffs) + [config.n_token]

    def logits(i: int) -> torch.Tensor:
        if config.div_val == 1:
            weight = state["crit.out_layers.0.weight"][ends[i] : ends[i + 1]]
            bias = state["crit.out_layers.0.bias"][ends[i] : ends[i + 1]]
        else:
            weight, bias = state[f"crit.out_layers.{i}.weight"], state[f"crit.out_layers.{i}.bias"]
        if i == 0:
            weight = torch.cat([weight, state["crit.cluster_weight"]])
            bias = torch.cat([bias, state["crit.cluster_bias"]])
        proj = state.get(f"crit.out_projs.{i}")
        projected = hidden if proj is None else hidden @ proj
        return projected @ weight.t() + bias

    head = F.log_softmax(logits(0), dim=-1)
    parts = [head[:, : ends[1]]]
    for i in range(1, len(ends) - 1):
        parts.append(head[:, -i, None] + F.log_softmax(logits(i), dim=-1))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("case", ["div_val2_three_tails", "div_val1_projected", "div_val1_unprojected_untied"])
def test_cluster_rows_follow_the_authors_head_indexing(case):
    model = _model(case)
    config = model.config
    original = to_original_state_dict(model.state_dict(), config)
    hidden = torch.randn(7, config.d_model)
    with torch.no_grad():
        ours = model.crit.log_prob(hidden)
        theirs = _authors_log_probs(original, config, hidden)
        # The same rule on our layout (row i-1 for cluster i) would be wrong: the check can fail.
        unconverted = _authors_log_probs(model.state_dict(), config, hidden)
    for start, end in zip(config.cutoffs, config.cutoffs[1:] + [config.n_token]):
        assert (ours[:, start:end] - theirs[:, start:end]).abs().max().item() <= 1e-4
    assert (ours[:, : config.cutoffs[0]] - theirs[:, : config.cutoffs[0]]).abs().max().item() <= 1e-4
    assert (ours - unconverted).abs().max().item() > 0.1


@pytest.mark.parametrize(
    "overrides,field", [(dict(untie_r=True), "untie_r"), (dict(layer_norm_eps=1e-6), "layer_norm_eps")]
)
def test_inexpressible_settings_are_refused(overrides, field):
    config = preset("tiny", **overrides)
    state = TransformerXLLM(config).state_dict()
    with pytest.raises(ValueError, match=f"model.{field}="):
        to_original_state_dict(state, config)
    with pytest.raises(ValueError, match=f"model.{field}="):
        from_original_state_dict(state, config)


def test_foreign_keys_and_wrong_config_are_errors():
    model = _model("div_val2_three_tails")
    original = to_original_state_dict(model.state_dict(), model.config)
    with pytest.raises(KeyError, match="layers.0.dec_attn.r_w_bias"):
        from_original_state_dict({**original, "layers.0.dec_attn.r_w_bias": original["r_w_bias"]}, model.config)
    with pytest.raises(ValueError, match="'r_emb'"):
        from_original_state_dict({**original, "r_emb": torch.zeros(2, 3, 2, 8)}, model.config)
    wider = preset("tiny", **{**CASES["div_val2_three_tails"], "d_model": 24})
    with pytest.raises(ValueError, match="pos_emb.inv_freq.*d_model=24"):
        from_original_state_dict(original, wider)


def test_load_original_reads_a_state_dict(tmp_path):
    model = _model("div_val1_projected")
    original = to_original_state_dict(model.state_dict(), model.config)
    path = save_original(original, tmp_path / "state_dict.pt")
    assert [p.name for p in tmp_path.iterdir()] == ["state_dict.pt"]  # no temporary file left
    loaded = load_original(path)
    assert sorted(loaded) == sorted(original)
    assert all(torch.equal(loaded[key], original[key]) for key in original)


class _PickledModel(torch.nn.Module):
    """Stands for the authors' MemTransformerLM saved whole with torch.save(model, f)."""

    def __init__(self):
        super().__init__()
        self.r_w_bias = torch.nn.Parameter(torch.zeros(2, 8))


def test_load_original_refuses_a_pickled_module_and_says_how_to_convert(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(_PickledModel(), path)
    with pytest.raises(ValueError, match=r"whole pickled module(.|\n)*state_dict\(\)"):
        load_original(path)
    torch.save([torch.zeros(3)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="expected a state dict"):
        load_original(tmp_path / "list.pt")
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_original(tmp_path / "missing.pt")
