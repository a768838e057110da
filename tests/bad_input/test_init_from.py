"""Bad input to train.init_from, refused by launchers/train.py in this process before any rank starts: exit
status 2 and one line naming the key and both values, the shards and the two tokenizers, or the path."""

from __future__ import annotations

import json

from tests.bad_input.helpers import _one_line
from tests.launcher import REPO, in_process

FINETUNE = str(REPO / "configs" / "finetune_cpu.yaml")


def _train(shards, output, *overrides: str):
    return in_process(
        "launchers/train.py",
        "--config",
        FINETUNE,
        f"data.shards={shards}",
        f"train.output_dir={output}",
        *overrides,
        check=False,
    )


def test_a_shape_changing_override_is_refused_naming_the_key_and_both_values(ptb_export, small_shards, tmp_path):
    result = _train(small_shards, tmp_path / "run", f"train.init_from={ptb_export}", "model.n_layer=3")
    assert result.returncode == 2
    _one_line(result, "model.n_layer=3", "on the command line", "whose n_layer is 2", str(ptb_export))
    result = _train(small_shards, tmp_path / "run", f"train.init_from={ptb_export}", "model.cutoffs=[2000]")
    _one_line(result, "model.cutoffs=[2000]", "whose cutoffs is [2000, 6000]")
    # A preset is an architecture too: named as the key to leave out.
    result = _train(small_shards, tmp_path / "run", f"train.init_from={ptb_export}", "model.preset=ptb_small")
    _one_line(result, "by model.preset=ptb_small", "leave model.preset out")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_settings_that_change_no_weight_and_equal_architecture_keys_are_taken(ptb_export, small_shards, tmp_path):
    result = in_process(
        "launchers/train.py",
        "--config",
        FINETUNE,
        f"data.shards={small_shards}",
        f"train.output_dir={tmp_path / 'run'}",
        f"train.init_from={ptb_export}",
        "model.n_layer=2",
        "model.dropout=0.3",
        "model.mem_len=24",
        "--print-config",
    )
    printed = result.stdout
    assert "n_layer: 2" in printed and "dropout: 0.3" in printed and "mem_len: 24" in printed
    assert "cutoffs: [2000, 6000]" in printed  # the model's, not the defaults'


def test_shards_of_another_tokenizer_are_refused(character_models, ptb_word_tokenizer, small_shards, tmp_path):
    byte_export = character_models["byte"]["export"]
    result = _train(small_shards, tmp_path / "run", f"train.init_from={byte_export}")
    assert result.returncode == 2
    _one_line(result, f"the shards {small_shards} were built with the tokenizer", f"--tokenizer {byte_export}")


def test_a_path_that_holds_no_model_is_refused(small_shards, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    for path, needle in (
        (tmp_path / "empty", "holds no model txl_dist reads"),
        (tmp_path / "notes.txt", "holds no model txl_dist reads"),
        (tmp_path / "missing", "no such file or folder"),
    ):
        result = _train(small_shards, tmp_path / "run", f"train.init_from={path}")
        assert result.returncode == 2
        _one_line(result, str(path), needle)


def test_a_damaged_record_of_the_run_is_named(ptb_export, small_shards, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "init_from.json").write_text(json.dumps(["not", "a", "record"]))
    result = _train(small_shards, tmp_path / "run", f"train.init_from={ptb_export}")
    assert result.returncode == 2
    _one_line(result, "init_from.json", "not a record of train.init_from")
