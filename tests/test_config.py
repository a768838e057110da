"""The run config: shipped files, precedence, errors that name the key and file, the DeepSpeed dict, the LR schedule,
the launcher's command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from deepspeed.runtime.config import DeepSpeedConfig

from txl_dist.config import (
    DataConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    load_config,
    with_manifest_vocab,
)
from txl_dist.config.model import PRESETS, ModelConfig
from txl_dist.config.sections import bucket_elements
from txl_dist.data.format import Manifest, SplitEntry, TokenizerIdentity, write_manifest
from txl_dist.training.deepspeed_config import build_deepspeed_config, build_torch_optimizer
from txl_dist.training.schedule import build_lr_scheduler, learning_rate
from txl_dist.training.startup import parse_run_args

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
VARIANTS = sorted((REPO / "configs" / "variants").glob("*.yaml"))


def ds_dict(cfg: RunConfig, world_size: int = 1, device: str = "cpu", overlay_path: str | None = None) -> dict:
    return build_deepspeed_config(
        train=cfg.train,
        optim=cfg.optim,
        precision=cfg.precision,
        zero=cfg.zero,
        world_size=world_size,
        device=device,
        overlay_path=overlay_path,
    )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --- shipped configs -------------------------------------------------------------------------------------------


def test_the_shipped_configs_are_found():
    names = {p.name for p in CONFIGS}
    assert {"tiny_cpu.yaml", "ptb_small.yaml", "lm1b_base.yaml", "lm1b_large.yaml"} <= names
    assert {"zero1.yaml", "zero2.yaml", "zero3.yaml", "bf16.yaml", "fp16.yaml", "fp32.yaml", "offload.yaml"} <= {
        p.name for p in VARIANTS
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_round_trips_and_gives_a_deepspeed_dict(path, tmp_path):
    cfg = load_config(path)
    # A fine-tuning config has no model section: train.init_from's model is the architecture.
    assert cfg.model_preset in PRESETS if not path.name.startswith("finetune") else cfg.model_preset is None
    dumped = write(tmp_path / "dumped.yaml", cfg.dump_yaml())
    assert load_config(dumped) == cfg
    device = "cuda" if cfg.precision.dtype == "fp16" else "cpu"
    dividing = 0
    for world_size in range(1, 9):
        per_pass = (cfg.train.micro_batch or 1) * world_size
        if cfg.train.global_batch % per_pass or (cfg.train.micro_batch is None and cfg.train.global_batch % world_size):
            with pytest.raises(ValueError, match=f"train.global_batch={cfg.train.global_batch}"):
                ds_dict(cfg, world_size, device)
            continue
        dividing += 1
        d = ds_dict(cfg, world_size, device)
        assert d["train_batch_size"] == cfg.train.global_batch
        assert (
            d["train_micro_batch_size_per_gpu"] * d["gradient_accumulation_steps"] * world_size
            == cfg.train.global_batch
        )
    assert dividing >= 2
    DeepSpeedConfig(ds_dict(cfg, 1, device))  # DeepSpeed's own checks (no process group: world size 1)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda p: p.name)
@pytest.mark.parametrize("base", CONFIGS, ids=lambda p: p.name)
def test_every_variant_layers_over_every_config(base, variant):
    cfg = load_config([base, variant])
    for section, values in yaml.safe_load(variant.read_text()).items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"
    assert (
        cfg.key_sources["zero" if "zero" in variant.name or "offload" in variant.name else "precision"]
        == f"in {os.path.normpath(variant)}"
    )
    device = "cuda" if cfg.precision.dtype == "fp16" else "cpu"
    d = ds_dict(cfg, 1, device)
    parsed = DeepSpeedConfig(d)
    assert parsed.zero_optimization_stage == cfg.zero.stage
    assert parsed.bfloat16_config.enabled == (cfg.precision.dtype == "bf16")
    assert parsed.float16_config.enabled == (cfg.precision.dtype == "fp16")


def test_lm1b_configs_carry_the_authors_hyperparameters():
    for name, batch, warmup, total, dropout in (
        ("lm1b_base", 224, 20000, 500000, 0.0),
        ("lm1b_large", 512, 30000, 1200000, 0.05),
    ):
        cfg = load_config(REPO / "configs" / f"{name}.yaml")
        assert (cfg.optim.lr, cfg.optim.grad_clip, cfg.optim.weight_decay) == (2.5e-4, 0.25, 0.0)
        assert (cfg.schedule.kind, cfg.schedule.warmup_steps, cfg.schedule.total_steps, cfg.schedule.min_lr) == (
            "cosine",
            warmup,
            total,
            0.0,
        )
        assert (cfg.train.global_batch, cfg.model.tgt_len, cfg.model.mem_len, cfg.model.dropout) == (
            batch,
            32,
            32,
            dropout,
        )
        assert (cfg.eval.tgt_len, cfg.eval.mem_len, cfg.eval.clamp_len, cfg.eval.same_length) == (32, 128, -1, True)
        assert cfg.data.shuffle_blocks and cfg.precision.dtype == "bf16" and cfg.zero.stage == 2


# --- precedence and includes -------------------------------------------------------------------------------------


def test_precedence_defaults_include_file_next_file_command_line(tmp_path):
    write(
        tmp_path / "parts" / "inc.yaml",
        """
        train: {max_steps: 10, seed: 5}
        optim: {lr: 0.1, eps: 1.0e-6}
        log: {every: 7}
    """,
    )
    base = write(
        tmp_path / "base.yaml",
        """
        include: [parts/inc.yaml]
        model: {preset: tiny, dropout: 0.2}
        train: {max_steps: 20}
        optim: {lr: 0.2}
    """,
    )
    second = write(tmp_path / "second.yaml", "optim: {lr: 0.3}\n")
    cfg = load_config([base, second], ["optim.lr=0.4", "model.d_embed=null", "model.cutoffs=[100,300]"])
    defaults = RunConfig()
    assert cfg.checkpoint == defaults.checkpoint  # untouched section: defaults
    assert cfg.log.every == 7 and cfg.optim.eps == 1e-6  # include only
    assert cfg.train.seed == 5 and cfg.train.max_steps == 20  # file over include
    assert cfg.optim.lr == 0.4  # command line over both files
    assert cfg.model == dataclasses.replace(
        ModelConfig(**PRESETS["tiny"]), dropout=0.2, d_embed=None, cutoffs=[100, 300]
    )
    assert cfg.model_preset == "tiny"
    assert cfg.key_sources["log.every"] == f"in {os.path.normpath(tmp_path / 'parts' / 'inc.yaml')}"
    assert cfg.key_sources["train.max_steps"] == f"in {base}"
    assert cfg.key_sources["optim.lr"] == "on the command line"
    assert cfg.key_sources.get("optim.betas") is None


def test_override_values_are_read_as_yaml():
    cfg = load_config(
        None,
        [
            "train.max_steps=100",
            "model.cutoffs=[20000,40000]",
            "model.n_token=50000",
            "model.d_embed=null",
            "optim.lr=1e-3",
            "data.shuffle_blocks=true",
            "train.output_dir='007'",
            "optim={lr: 0.5, eps: 1.0e-7}",
        ],
    )
    assert cfg.train.max_steps == 100 and cfg.model.cutoffs == [20000, 40000] and cfg.model.d_embed is None
    assert cfg.data.shuffle_blocks is True and cfg.train.output_dir == "007"
    assert cfg.optim.lr == 0.5 and cfg.optim.eps == 1e-7  # the whole-section override came last


def test_an_empty_section_means_the_defaults(tmp_path):
    path = write(tmp_path / "x.yaml", "eval:\n  # every: 5\ntrain: {seed: 9}\n")
    cfg = load_config(path)
    assert cfg.eval == RunConfig().eval and cfg.train.seed == 9


def test_yaml_float_spellings_that_pyyaml_reads_as_strings_are_numbers(tmp_path):
    path = write(tmp_path / "x.yaml", "optim: {lr: 1e-3, eps: 1E-8}\nmodel: {dropout: 0}\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.eps, cfg.model.dropout) == (1e-3, 1e-8, 0.0)
    assert isinstance(cfg.model.dropout, float)


def test_include_cycle_is_refused(tmp_path):
    write(tmp_path / "a.yaml", "include: [sub/b.yaml]\n")
    write(tmp_path / "sub" / "b.yaml", "include: [../a.yaml]\n")
    with pytest.raises(ValueError, match=r"include cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")


def test_the_same_file_included_twice_is_not_a_cycle(tmp_path):
    write(tmp_path / "common.yaml", "log: {every: 3}\n")
    write(tmp_path / "a.yaml", "include: common.yaml\ntrain: {seed: 1}\n")
    write(tmp_path / "b.yaml", "include: [common.yaml, a.yaml]\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert cfg.log.every == 3 and cfg.train.seed == 1


def test_missing_include_names_the_including_file(tmp_path):
    path = write(tmp_path / "a.yaml", "include: [nope.yaml]\n")
    with pytest.raises(ValueError, match=rf"nope\.yaml: no such config file \(included from {path}\)"):
        load_config(path)


# --- errors name the key, the value, what is allowed and where --------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("train: {micro_batch: 0}", "train.micro_batch=0 is not allowed: a positive integer"),
        (
            "train: {global_batch: 8, micro_batch: 3}",
            "train.micro_batch=3 is not allowed: a divisor of train.global_batch=8",
        ),
        (
            "optim: {learning_rate: 0.1}",
            "unknown key 'optim.learning_rate' in {file}; allowed keys in optim: name, lr,",
        ),
        ("optimizer: {lr: 0.1}", "unknown section 'optimizer' in {file}; allowed sections: model, data,"),
        (
            "model: {preset: huge}",
            "model.preset='huge' is not allowed: null or one of ['enwik8_base', 'enwik8_large', 'lm1b_base'",
        ),
        ("model: {hidden: 3}", "unknown key 'model.hidden' in {file}; allowed keys in model: preset, n_token,"),
        ("model: {dropout: 1.5}", "model.dropout=1.5 is not allowed: a probability in [0, 1)"),
        ("model: {cutoffs: [5, x]}", "model.cutoffs=[5, 'x'] is not allowed: a list of integers"),
        ("model: {tie_weight: 'yes'}", "model.tie_weight='yes' is not allowed: a boolean (true or false)"),
        ("optim: {lr: fast}", "optim.lr='fast' is not allowed: a finite number"),
        ("optim: {lr: .inf}", "optim.lr=inf is not allowed: a finite number"),
        ("optim: {name: sgd}", "optim.name='sgd' is not allowed: one of ['adamw', 'adam']"),
        ("optim: {betas: [0.9, 1.0]}", "optim.betas=[0.9, 1.0] is not allowed: two numbers in [0, 1)"),
        ("zero: {stage: '2'}", "zero.stage='2' is not allowed: one of [0, 1, 2, 3]"),
        ("zero: {stage: true}", "zero.stage=True is not allowed: one of [0, 1, 2, 3]"),
        ("zero: {offload_optimizer: cpu}", "zero.offload_optimizer='cpu' is not allowed: 'none' with zero.stage=0"),
        ("train: {seed: 1.5}", "train.seed=1.5 is not allowed: an integer"),
        (
            "train: {max_steps: 100}\nschedule: {warmup_steps: 200}",
            "schedule.warmup_steps=200 is not allowed: at most the schedule's length, train.max_steps=100",
        ),
        ("schedule: {kind: constant, min_lr: 1.0e-5}", "schedule.min_lr=1e-05 is not allowed: 0 with schedule.kind"),
        (
            "schedule: {kind: linear}",
            "schedule.kind='linear' is not allowed: one of ['cosine', 'inv_sqrt', 'constant']",
        ),
        (
            "optim: {lr: 1.0e-4}\nschedule: {min_lr: 1.0e-3}",
            "schedule.min_lr=0.001 is not allowed: at most optim.lr=0.0001",
        ),
        (
            "eval: {mem_len: 0, same_length: true}",
            "eval.same_length=True is not allowed: false when the evaluation mem_len",
        ),
        ("precision: {dtype: fp8}", "precision.dtype='fp8' is not allowed: one of ['fp32', 'bf16', 'fp16']"),
        ("data: {shards: 12}", "data.shards=12 is not allowed: a string"),
        ("log: {every: 0}", "log.every=0 is not allowed: a positive integer"),
        ("train: 5", "train=5 is not allowed: a mapping of train keys"),
    ],
)
def test_bad_values_name_the_key_the_value_what_is_allowed_and_the_file(tmp_path, text, message):
    path = write(tmp_path / "bad.yaml", text + "\n")
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert message.format(file=path) in str(error.value)
    assert str(path) in str(error.value)


def test_a_bad_value_from_the_command_line_says_so(tmp_path):
    path = write(tmp_path / "ok.yaml", "train: {max_steps: 10}\n")
    with pytest.raises(
        ValueError,
        match=r"^train.max_steps=-1 is not allowed: a positive integer "
        r"\(set on the command line\)$",
    ):
        load_config(path, ["train.max_steps=-1"])
    with pytest.raises(ValueError, match="unknown key 'train.steps' on the command line"):
        load_config(path, ["train.steps=3"])


@pytest.mark.parametrize("override", ["train.max_steps", "=3", "train..x=1", "optim.betas.0=0.5"])
def test_malformed_overrides_are_refused(override):
    with pytest.raises(ValueError, match=r"is not section.key=value"):
        load_config(None, [override])


def test_bad_yaml_files_are_named(tmp_path):
    for name, text, message in (
        ("dup.yaml", "train:\n  seed: 1\n  seed: 2\n", "duplicate key 'seed'"),
        ("syntax.yaml", "train: {seed: 1\n", "not valid YAML"),
        ("list.yaml", "- 1\n", "the top level must be a mapping"),
        ("inc.yaml", "include: 3\n", "include=3 is not allowed"),
    ):
        path = write(tmp_path / name, text)
        with pytest.raises(ValueError, match=message) as error:
            load_config(path)
        assert str(path) in str(error.value)
    with pytest.raises(ValueError, match="absent.yaml: no such config file"):
        load_config(tmp_path / "absent.yaml")


def test_grad_accum_arithmetic_error_names_the_three_numbers():
    train = TrainConfig(global_batch=24, micro_batch=4)
    assert train.batch_split(3) == (4, 2, 3)
    with pytest.raises(
        ValueError,
        match=r"train.global_batch=24 with train.micro_batch=4 cannot be split over 4 ranks .*: the world sizes "
        r"that can hold it are 1, 2, 3, 6;",
    ):
        train.batch_split(4)
    with pytest.raises(
        ValueError, match=r"train.global_batch=24 with train.micro_batch null .* cannot be split over 5 ranks"
    ):
        TrainConfig(global_batch=24).batch_split(5)
    assert TrainConfig(global_batch=24).batch_split(6) == (4, 1, 6)
    for micro_batch, why in ((30, "is larger than the global batch 24"), (5, "does not divide the global batch 24")):
        with pytest.raises(ValueError) as refused:
            TrainConfig(global_batch=24).batch_split(2, micro_batch)
        assert str(refused.value).endswith(
            f"no world size can hold it: the micro-batch {micro_batch} {why}; the micro-batches that divide it: "
            "1, 2, 3, 4, 6, 8, 12, 24"
        ), refused.value


# --- resolved config ---------------------------------------------------------------------------------------------


def test_from_dict_rebuilds_an_equal_config_and_names_its_source():
    cfg = load_config(REPO / "configs" / "lm1b_base.yaml", ["model.dropout=0.1", "eval.max_batches=3"])
    assert RunConfig.from_dict(cfg.to_dict(), "checkpoint x") == cfg
    data = cfg.to_dict()
    data["train"]["max_step"] = 5
    with pytest.raises(ValueError, match="unknown key 'train.max_step' in checkpoint x"):
        RunConfig.from_dict(data, "checkpoint x")


def test_eval_resolve_takes_the_models_segment_settings():
    cfg = load_config(None, ["model.preset=tiny", "eval.mem_len=32"])
    resolved = cfg.eval.resolve(cfg.model)
    assert (resolved.tgt_len, resolved.mem_len, resolved.clamp_len, resolved.same_length) == (
        PRESETS["tiny"]["tgt_len"],
        32,
        -1,
        False,
    )


def test_manifest_vocab_replaces_a_preset_value_but_must_match_a_given_one():
    cfg = load_config(None, ["model.preset=ptb_small"])
    assert with_manifest_vocab(cfg, 10001, "manifest M").model.n_token == 10001
    with pytest.raises(ValueError, match=r"model.cutoffs=\[2000, 4000\] is not allowed.*n_token=3000 from manifest M"):
        with_manifest_vocab(cfg, 3000, "manifest M")
    explicit = load_config(None, ["model.preset=ptb_small", "model.n_token=10000"])
    assert with_manifest_vocab(explicit, 10000, "manifest M").model.n_token == 10000
    with pytest.raises(
        ValueError,
        match=r"model.n_token=10000 \(set on the command line\) disagrees with "
        r"manifest M: vocab_size 10001",
    ):
        with_manifest_vocab(explicit, 10001, "manifest M")


def test_sections_validate_on_their_own():
    with pytest.raises(ValueError, match="data.train_split='' is not allowed: a non-empty string"):
        DataConfig(train_split="").validate()
    schedule = ScheduleConfig(min_lr=0)
    schedule.validate()
    assert isinstance(schedule.min_lr, float)


# --- the DeepSpeed dict ------------------------------------------------------------------------------------------


def test_deepspeed_dict_maps_every_section():
    cfg = load_config(
        REPO / "configs" / "tiny_cpu.yaml",
        ["zero.stage=3", "optim.grad_clip=0.5", "optim.weight_decay=0.01", "optim.betas=[0.8,0.9]"],
    )
    d = ds_dict(cfg, world_size=2, device="cpu")
    assert (d["train_batch_size"], d["train_micro_batch_size_per_gpu"], d["gradient_accumulation_steps"]) == (8, 2, 2)
    assert d["gradient_clipping"] == 0.5
    assert "optimizer" not in d  # torch's fused AdamW, built by the trainer
    deepspeed_adam = ds_dict(
        load_config(
            REPO / "configs" / "tiny_cpu.yaml",
            ["optim.weight_decay=0.01", "optim.betas=[0.8,0.9]", "optim.implementation=deepspeed"],
        ),
        world_size=2,
        device="cpu",
    )
    assert deepspeed_adam["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-3, "betas": [0.8, 0.9], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
    }
    assert d["zero_optimization"]["stage"] == 3
    assert d["zero_optimization"]["stage3_param_persistence_threshold"] == cfg.zero.stage3_param_persistence_threshold
    assert "bf16" not in d and "fp16" not in d
    assert d["wall_clock_breakdown"] is False and d["steps_per_print"] >= 10**9


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_buckets_are_capped_at_the_models_size(stage):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"zero.stage={stage}"])

    def zero_section(num_parameters):
        return build_deepspeed_config(
            train=cfg.train,
            optim=cfg.optim,
            precision=cfg.precision,
            zero=cfg.zero,
            world_size=2,
            device="cpu",
            num_parameters=num_parameters,
        )["zero_optimization"]

    keys = ["reduce_bucket_size"] + (["allgather_bucket_size"] if stage < 3 else [])
    assert [zero_section(None)[k] for k in keys] == [cfg.zero.bucket_size] * len(keys)
    assert [zero_section(59_602)[k] for k in keys] == [59_904] * len(keys)  # rounded up to a multiple of 512
    assert [zero_section(10**12)[k] for k in keys] == [cfg.zero.bucket_size] * len(keys)
    assert bucket_elements(cfg.zero, 59_904) == 59_904 and bucket_elements(cfg.zero, None) == cfg.zero.bucket_size


def test_optimizer_choice_follows_implementation_device_and_offload():
    cfg = load_config(REPO / "configs" / "lm1b_base.yaml")
    assert "optimizer" not in ds_dict(cfg, 8, "cuda")
    optimizer = build_torch_optimizer(cfg.optim, [torch.nn.Parameter(torch.zeros(3))])
    assert type(optimizer) is torch.optim.Adam and optimizer.defaults["fused"] is True
    assert optimizer.defaults["lr"] == cfg.optim.lr and optimizer.defaults["betas"] == tuple(cfg.optim.betas)
    cfg = load_config(REPO / "configs" / "lm1b_base.yaml", ["optim.implementation=deepspeed"])
    cuda = ds_dict(cfg, 8, "cuda")["optimizer"]
    assert cuda["type"] == "Adam" and cuda["params"]["adam_w_mode"] is False and "torch_adam" not in cuda["params"]
    offloaded = load_config([REPO / "configs" / "lm1b_base.yaml", REPO / "configs" / "variants" / "offload.yaml"])
    for device, pinned in (("cuda", True), ("cpu", False)):
        d = ds_dict(offloaded, 8, device)
        assert "torch_adam" not in d["optimizer"]["params"]  # DeepSpeed's CPU Adam
        assert d["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": pinned}


def test_fp16_dict_uses_dynamic_loss_scaling_and_is_refused_on_cpu():
    cfg = load_config(
        [REPO / "configs" / "tiny_cpu.yaml", REPO / "configs" / "variants" / "fp16.yaml"],
        ["precision.initial_scale_power=12"],
    )
    fp16 = ds_dict(cfg, 2, "cuda")["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 12
    with pytest.raises(ValueError, match="precision.dtype='fp16' is not allowed on device cpu"):
        ds_dict(cfg, 2, "cpu")


def test_deepspeed_config_overlay_merges_but_refuses_batch_and_owned_keys(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml")
    overlay = tmp_path / "ds.json"
    overlay.write_text(json.dumps({"zero_optimization": {"overlap_comm": True}, "communication_data_type": "fp32"}))
    d = ds_dict(cfg, 2, "cpu", str(overlay))
    assert d["zero_optimization"]["overlap_comm"] is True and d["zero_optimization"]["stage"] == 2
    assert d["communication_data_type"] == "fp32"
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        overlay.write_text(json.dumps({key: 4}))
        with pytest.raises(
            ValueError,
            match=rf"--deepspeed_config {overlay} sets '{key}', which is not allowed: "
            r"batch sizes are stated once, in train.global_batch",
        ):
            ds_dict(cfg, 2, "cpu", str(overlay))
    for key in ("scheduler", "optimizer"):
        overlay.write_text(json.dumps({key: {"type": "WarmupLR"}}))
        with pytest.raises(ValueError, match=f"sets '{key}'"):
            ds_dict(cfg, 2, "cpu", str(overlay))
    overlay.write_text(json.dumps({"steps_per_print": 10}))
    assert ds_dict(cfg, 2, "cpu", str(overlay))["steps_per_print"] == 10  # no config key sets it
    overlay.write_text("{not json")
    with pytest.raises(ValueError, match=rf"--deepspeed_config {overlay}: not valid JSON"):
        ds_dict(cfg, 2, "cpu", str(overlay))


@pytest.mark.parametrize(
    "overlay, key, instead",
    [
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "zero.stage"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer",
            "zero.offload_optimizer",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 512}},
            "zero_optimization.reduce_bucket_size",
            "zero.bucket_size",
        ),
        (
            {"zero_optimization": {"stage3_max_live_parameters": 9}},
            "zero_optimization.stage3_max_live_parameters",
            "zero.stage3_max_live_parameters",
        ),
        ({"gradient_clipping": 1.0}, "gradient_clipping", "optim.grad_clip"),
        ({"bf16": {"enabled": True}}, "bf16", "precision.dtype"),
        ({"bf16": {"enabled": False}}, "bf16", "precision.dtype"),
        ({"fp16": {"enabled": False}}, "fp16", "precision.dtype"),
        ({"bfloat16": {"enabled": True}}, "bfloat16", "precision.dtype"),
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast", "precision.dtype"),
        ({"optimizer": {"params": {"lr": 1}}}, "optimizer", "optim section"),
    ],
)
def test_a_deepspeed_config_overlay_may_not_set_what_the_run_config_owns(tmp_path, overlay, key, instead):
    """Every key the builder writes from the config, under any stage, offload or precision (the run's config
    here is ZeRO-2, fp32, no offload), is refused naming the key and the config key to set instead: the engine
    must run what the memory plan, the resolved config and the hparams say."""
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(overlay))
    with pytest.raises(ValueError, match=rf"--deepspeed_config {path} sets '{key}', which is not allowed: .*{instead}"):
        ds_dict(cfg, 2, "cpu", str(path))


@pytest.mark.parametrize(
    "section, stage, key, owned",
    [
        ({"cpu_offload": True}, 2, "cpu_offload", "offload_optimizer"),
        ({"cpu_offload": False}, 2, "cpu_offload", "offload_optimizer"),
        ({"cpu_offload_use_pin_memory": True}, 2, "cpu_offload_use_pin_memory", "offload_optimizer"),
        ({"prefetch_bucket_size": 7}, 3, "prefetch_bucket_size", "stage3_prefetch_bucket_size"),
        ({"param_persistence_threshold": 7}, 3, "param_persistence_threshold", "stage3_param_persistence_threshold"),
        ({"max_live_parameters": 7}, 2, "max_live_parameters", "stage3_max_live_parameters"),
    ],
)
def test_a_deepspeed_config_overlay_may_not_set_an_owned_zero_key_under_deepspeeds_other_name(
    tmp_path, section, stage, key, owned
):
    """DeepSpeed reads `cpu_offload` as offload_optimizer and a stage-3 field by its name or its ``stage3_``
    alias: each is refused as the owned key itself would be, naming the file, the key and the config key."""
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"zero.stage={stage}"])
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": section}))
    with pytest.raises(ValueError) as refused:
        ds_dict(cfg, 2, "cpu", str(path))
    assert str(refused.value) == (
        f"--deepspeed_config {path} sets 'zero_optimization.{key}' (DeepSpeed's alias of '{owned}'), which is not "
        f"allowed: the ZeRO setting is zero.{owned}"
    )


@pytest.mark.parametrize(
    "section, stage, expected",
    [
        ({"overlap_com": True}, 2, "sets 'zero_optimization.overlap_com' to True, which DeepSpeed refuses: no such"),
        ({"sub_group_size": -1}, 3, "sets 'zero_optimization.sub_group_size' to -1, which DeepSpeed refuses: Input"),
        (
            {"offload_param": {"device": "gpu"}},
            3,
            "sets 'zero_optimization.offload_param.device' to 'gpu', which DeepSpeed refuses: Input should be",
        ),
        ({"compute_grad_norm": False}, 3, ": DeepSpeed refuses the 'zero_optimization' section (the run config's"),
        ({"cpu_offload_param": True, "offload_param": {"device": "cpu"}}, 3, "Cannot provide deprecated parameter"),
    ],
)
def test_a_zero_section_that_deepspeed_refuses_is_one_line_naming_the_overlay_and_the_key(
    tmp_path, capsys, section, stage, expected
):
    """DeepSpeed's own model of the zero_optimization section checks the merged section when the config is read:
    a refusal is one line naming the --deepspeed_config file and the key, status 2, not pydantic's lines on
    every rank once the engine starts."""
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"zero.stage={stage}"])
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": section}))
    with pytest.raises(ValueError) as refused:
        ds_dict(cfg, 2, "cpu", str(path))
    message = str(refused.value)
    assert message.startswith(f"--deepspeed_config {path}") and expected in message and "\n" not in message
    shards = shard_dir(tmp_path, vocab_size=1000)
    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    argv = ["--config", tiny, f"data.shards={shards}", f"zero.stage={stage}", "--deepspeed_config", str(path)]
    err = parse_error(capsys, argv)
    assert len(err.strip().splitlines()) == 1 and expected in err
    path.write_text(json.dumps({"zero_optimization": {"overlap_comm": True, "cpu_offload_param": False}}))
    assert ds_dict(cfg, 2, "cpu", str(path))["zero_optimization"]["overlap_comm"] is True  # DeepSpeed takes these


def test_a_deepspeed_config_overlay_may_not_replace_the_zero_section(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": 3}))
    with pytest.raises(ValueError, match=rf"{path} sets 'zero_optimization' to 3, which is not allowed: .*zero.stage"):
        ds_dict(cfg, 2, "cpu", str(path))


ENGINE_PROBE = """
import json, sys
import deepspeed, torch
from txl_dist.config import load_config
from txl_dist.config.sections import bucket_elements
from txl_dist.training.deepspeed_config import build_deepspeed_config, build_torch_optimizer
from txl_dist.training.schedule import build_lr_scheduler
deepspeed.init_distributed(dist_backend="gloo")
for files in json.loads(sys.argv[1]):
    cfg = load_config(files, ["schedule.warmup_steps=2"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    ds = build_deepspeed_config(train=cfg.train, optim=cfg.optim, precision=cfg.precision, zero=cfg.zero,
                                world_size=1, device="cpu", num_parameters=sum(p.numel() for p in model.parameters()))
    optimizer = None if "optimizer" in ds else build_torch_optimizer(cfg.optim, model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, optimizer=optimizer,
        lr_scheduler=lambda optimizer: build_lr_scheduler(optimizer, cfg.schedule, cfg.train.max_steps))
    lrs = []
    for _ in range(3):
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randn(engine.train_micro_batch_size_per_gpu(), 8, dtype=next(engine.module.parameters()).dtype)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        lrs.append(engine.get_lr()[0])
    print("RESULT", json.dumps({"optimizer": type(engine.basic_optimizer).__name__, "lrs": lrs,
                                "fused": bool(engine.basic_optimizer.defaults.get("fused")),
                                "steps": engine.global_steps,
                                "bucket": getattr(engine.optimizer, "reduce_bucket_size", None)}), flush=True)
"""


def test_deepspeed_builds_engines_from_the_dicts_on_cpu(tmp_path, deepspeed_op_cache):
    """A real single-rank engine (gloo, in a child process so that no process group leaks into other tests) for
    ZeRO 0-3, bf16 and plain Adam; its LR after each optimizer step follows the schedule. Offload is left out:
    DeepSpeed's CPU Adam compiles for ~45 s on first use."""
    tiny, variants = REPO / "configs" / "tiny_cpu.yaml", REPO / "configs" / "variants"
    stage0 = write(tmp_path / "stage0.yaml", "zero: {stage: 0}\n")
    runs = [[str(tiny), str(stage0)]]
    runs += [[str(tiny), str(variants / name)] for name in ("zero1.yaml", "zero2.yaml", "zero3.yaml", "bf16.yaml")]
    runs.append([str(REPO / "configs" / "ptb_small.yaml")])
    runs.append([str(tiny), str(write(tmp_path / "ds_adam.yaml", "optim: {implementation: deepspeed}\n"))])
    from tests.launcher import free_port

    port = free_port()  # recorded, so that the fixture removes this run's shared-memory buffers
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_PROBE, json.dumps(runs)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["optimizer"] for r in results] == ["AdamW"] * 5 + ["Adam", "AdamW"]
    assert [r["fused"] for r in results] == [True] * 6 + [False]
    # ZeRO 1-3 (all but the first: tiny_cpu is ZeRO-2) reduce gradients in buckets of the model's 161 elements
    # (rounded up to 512), not zero.bucket_size (200M, allocated at every step)
    assert [r["bucket"] for r in results] == [None] + [512] * 6
    for files, result in zip(runs, results):
        cfg = load_config(files)
        peak, total = cfg.optim.lr, cfg.schedule.total_steps or cfg.train.max_steps
        # warmup 2: step 1 is half way up; steps 2 and 3 are on the cosine of the absolute step
        expected = [peak / 2] + [0.5 * peak * (1 + math.cos(math.pi * k / total)) for k in (2, 3)]
        assert result["steps"] == 3
        assert result["lrs"] == pytest.approx(expected, rel=1e-9)


# --- the schedule ------------------------------------------------------------------------------------------------


def test_cosine_schedule_matches_the_closed_form():
    peak, floor, warmup, total = 2.5e-4, 1e-5, 100, 1000
    schedule = ScheduleConfig(kind="cosine", warmup_steps=warmup, total_steps=total, min_lr=floor)

    def at(step):  # total_steps wins over max_steps
        return learning_rate(step, peak, schedule, max_steps=50)

    assert at(0) == 0.0
    assert at(25) == pytest.approx(peak / 4)
    assert at(warmup) == pytest.approx(floor + (peak - floor) * (1 + math.cos(math.pi * 0.1)) / 2)
    assert at(500) == pytest.approx((peak + floor) / 2)
    assert at(total) == pytest.approx(floor)
    assert at(total + 500) == pytest.approx(floor)
    default_total = ScheduleConfig(kind="cosine")
    assert learning_rate(300, 1.0, default_total, max_steps=600) == pytest.approx(0.5)


def test_inv_sqrt_and_constant_schedules_match_the_closed_form():
    peak, warmup = 1e-3, 400
    inv_sqrt = ScheduleConfig(kind="inv_sqrt", warmup_steps=warmup)
    assert learning_rate(100, peak, inv_sqrt, 10**6) == pytest.approx(peak / 4)
    assert learning_rate(warmup, peak, inv_sqrt, 10**6) == pytest.approx(peak)
    assert learning_rate(4 * warmup, peak, inv_sqrt, 10**6) == pytest.approx(peak / 2)
    # the authors' 1/sqrt(step) with warmup step/W**1.5, times sqrt(W)
    for step in (1, 250, 399, 400, 401, 10_000):
        authors = step / warmup**1.5 if step <= warmup else 1 / math.sqrt(step)
        assert learning_rate(step, peak, inv_sqrt, 10**6) == pytest.approx(peak * authors * math.sqrt(warmup))
    floored = ScheduleConfig(kind="inv_sqrt", warmup_steps=warmup, min_lr=3e-4)
    assert learning_rate(100 * warmup, peak, floored, 10**6) == pytest.approx(3e-4)
    no_warmup = ScheduleConfig(kind="inv_sqrt")
    assert [learning_rate(s, peak, no_warmup, 10) for s in (0, 1, 4)] == pytest.approx([peak, peak, peak / 2])
    constant = ScheduleConfig(kind="constant", warmup_steps=10)
    assert [learning_rate(s, peak, constant, 100) for s in (5, 10, 99)] == pytest.approx([peak / 2, peak, peak])


def test_lr_scheduler_drives_every_param_group_and_resumes_from_its_state():
    schedule = ScheduleConfig(kind="cosine", warmup_steps=3, total_steps=10, min_lr=1e-4)

    def make():
        a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([{"params": [a], "lr": 1e-2}, {"params": [b], "lr": 1e-3}])
        return optimizer, build_lr_scheduler(optimizer, schedule, max_steps=10)

    optimizer, scheduler = make()
    seen = []
    for _ in range(12):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    for step, (lr_a, lr_b) in enumerate(seen):
        assert lr_a == pytest.approx(learning_rate(step, 1e-2, schedule, 10))
        assert lr_b == pytest.approx(learning_rate(step, 1e-3, schedule, 10))
    # a group's floor is min_lr whatever its peak
    assert seen[10] == pytest.approx([1e-4, 1e-4])

    saved_optimizer, saved_scheduler = make()
    for _ in range(5):
        saved_optimizer.step()
        saved_scheduler.step()
    state = saved_scheduler.state_dict()
    assert not any(callable(v) for v in state.get("lr_lambdas", [])) and state["last_epoch"] == 5
    resumed_optimizer, resumed_scheduler = make()
    resumed_optimizer.load_state_dict(saved_optimizer.state_dict())
    resumed_scheduler.load_state_dict(state)
    resumed_optimizer.step()
    resumed_scheduler.step()
    assert [g["lr"] for g in resumed_optimizer.param_groups] == pytest.approx(seen[6])


# --- the launcher's command line ---------------------------------------------------------------------------------


def shard_dir(tmp_path: Path, vocab_size: int) -> Path:
    directory = tmp_path / "shards"
    directory.mkdir()
    identity = TokenizerIdentity(kind="word", vocab_size=vocab_size, fingerprint="f" * 64, eos_id=0, eod_id=0)
    # The splits the run reads (empty: these tests stop before any is opened).
    splits = {name: SplitEntry(documents=0, tokens=0, blocks=0, shards=[]) for name in ("train", "valid")}
    write_manifest(directory, Manifest(tokenizer=identity, dtype="uint16", block_tokens=512, splits=splits))
    return directory


def test_parse_run_args_builds_the_config_and_takes_the_vocab_from_the_manifest(tmp_path):
    shards = shard_dir(tmp_path, vocab_size=1234)
    cfg, args = parse_run_args(
        [
            "--local_rank=1",
            "--config",
            str(REPO / "configs" / "tiny_cpu.yaml"),
            f"data.shards={shards}",
            "--config",
            str(REPO / "configs" / "variants" / "zero3.yaml"),
            f"train.output_dir={tmp_path / 'run'}",
            "train.max_steps=7",
            "train.seed=3",
        ],
        world_size=2,
        device="cpu",
    )
    assert cfg.model.n_token == 1234 and cfg.zero.stage == 3
    assert (cfg.train.max_steps, cfg.train.seed, cfg.train.output_dir) == (7, 3, str(tmp_path / "run"))
    assert args.local_rank == 1 and args.deepspeed_config is None


def parse_error(capsys, argv, world_size=2) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(argv, world_size=world_size, device="cpu")
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_parse_run_args_fails_before_training_with_the_key_named(capsys, tmp_path):
    tiny = str(REPO / "configs" / "tiny_cpu.yaml")
    shards = shard_dir(tmp_path, vocab_size=1000)
    assert "data.shards is not set" in parse_error(capsys, ["--config", tiny])
    assert "train.output_dir is not set" in parse_error(
        capsys, ["--config", tiny, f"data.shards={shards}", "train.output_dir=null"]
    )
    assert f"data.shards='{tmp_path}' is not allowed: a local directory holding manifest.json" in parse_error(
        capsys, ["--config", tiny, f"data.shards={tmp_path}"]
    )
    assert "data.shards='s3://bucket/lm1b' is not allowed: a local directory" in parse_error(
        capsys, ["--config", tiny, "data.shards=s3://bucket/lm1b"]
    )
    assert "train.micro_batch=0 is not allowed" in parse_error(capsys, ["--config", tiny, "train.micro_batch=0"])
    assert "train.global_batch=8 with train.micro_batch=2 cannot be split over 3 ranks" in parse_error(
        capsys, ["--config", tiny, f"data.shards={shards}"], world_size=3
    )
    assert "model.n_token=999 (set on the command line) disagrees with the manifest" in parse_error(
        capsys, ["--config", tiny, f"data.shards={shards}", "model.n_token=999"]
    )
    overlay = tmp_path / "ds.json"
    overlay.write_text('{"gradient_accumulation_steps": 1}')
    assert "batch sizes are stated once" in parse_error(
        capsys, ["--config", tiny, f"data.shards={shards}", "--deepspeed", "--deepspeed_config", str(overlay)]
    )
    overlay.write_text('{"zero_optimization": {"stage": 3}}')
    assert "sets 'zero_optimization.stage', which is not allowed: the ZeRO setting is zero.stage" in parse_error(
        capsys, ["--config", tiny, f"data.shards={shards}", "--deepspeed_config", str(overlay)]
    )


def test_print_config_prints_a_config_that_reloads_equal(capsys, tmp_path):
    argv = ["--config", str(REPO / "configs" / "lm1b_large.yaml"), "model.dropout=0.1", "--print-config"]
    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(argv, world_size=4, device="cuda")
    assert exit_info.value.code == 0
    printed = write(tmp_path / "printed.yaml", capsys.readouterr().out)
    reloaded = load_config(printed)
    assert reloaded == load_config(REPO / "configs" / "lm1b_large.yaml", ["model.dropout=0.1"])
    assert reloaded.model.dropout == 0.1 and reloaded.model_preset == "lm1b_large"


def test_the_launcher_declares_deepspeeds_config_flags_as_deepspeed_does():
    """txl_dist.training.arguments declares DeepSpeed's flags itself (so that --help imports no DeepSpeed): each
    flag `deepspeed.add_config_arguments` adds is there, with its destination, action, type and default, and
    parses the same command line to the same values."""
    import argparse

    import deepspeed

    from txl_dist.training.arguments import add_deepspeed_arguments, build_arg_parser

    theirs = deepspeed.add_config_arguments(argparse.ArgumentParser())
    ours = add_deepspeed_arguments(argparse.ArgumentParser())

    def flags(parser):
        return {
            option: (action.dest, type(action).__name__, action.type, action.default, action.nargs)
            for action in parser._actions
            for option in action.option_strings
            if option not in ("-h", "--help")
        }

    assert flags(theirs) and flags(ours) == flags(theirs)
    launcher = flags(build_arg_parser())
    assert {option: launcher.get(option) for option in flags(theirs)} == flags(theirs)  # the launcher's own parser
    argv = ["--deepspeed", "--deepspeed_config", "ds.json", "--deepscale", "--deepscale_config", "old.json"]
    assert vars(ours.parse_args(argv)) == vars(theirs.parse_args(argv))
    assert vars(ours.parse_args([])) == vars(theirs.parse_args([]))
