"""Bad configuration given to txl_dist.config (load_config, and through it every command's --config and
overrides): a section's layers, include lists, YAML (merge keys, syntax, anchors that hold themselves, nesting), the
config file itself, and the ranges of numbers. Each is one line naming the file and the key."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch

from tests.bad_input.helpers import TINY
from txl_dist.config import load_config

INT64_MAX = 2**63 - 1


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# ---- a section's layers: empty, scalar, mapping and unknown sections -------------------------------------------------


@pytest.mark.parametrize("empty", ["train:\n#  seed: 3\n", "train: null\n", "train: ~\n"])
def test_an_empty_section_keeps_what_the_included_file_set(tmp_path, empty):
    path = write(tmp_path / "run.yaml", f"include: [{TINY}]\n{empty}")
    cfg = load_config(path)
    assert (cfg.train.max_steps, cfg.train.global_batch, cfg.train.seed) == (20, 8, 1234)


def test_an_empty_section_in_a_later_file_or_on_the_command_line_changes_nothing(tmp_path):
    later = write(tmp_path / "later.yaml", "train:\neval:\n")
    cfg = load_config([TINY, later], ["train=null", "model=null"])
    assert (cfg.train.max_steps, cfg.train.seed, cfg.eval.every, cfg.model.n_layer) == (20, 1234, 10, 2)


def test_an_empty_section_in_a_file_between_two_includes_keeps_the_innermost(tmp_path):
    middle = write(tmp_path / "sub" / "middle.yaml", f"include: [{TINY}]\ntrain:\noptim: ~\n")
    outer = write(tmp_path / "outer.yaml", "include: [sub/middle.yaml]\ntrain: {seed: 5}\n")
    cfg = load_config(outer)
    assert (cfg.train.seed, cfg.train.max_steps, cfg.optim.lr) == (5, 20, 1e-3)
    assert cfg.key_sources["train.max_steps"] == f"in {TINY}" and middle.is_file()


@pytest.mark.parametrize("value", ["5", "[1, 2]", "fast", "true"])
@pytest.mark.parametrize("overrides", [[], ["train.max_steps=3"]])
def test_a_scalar_or_list_where_a_section_belongs_names_the_file_and_key(tmp_path, value, overrides):
    path = write(tmp_path / "run.yaml", f"include: [{TINY}]\ntrain: {value}\n")
    with pytest.raises(ValueError, match=rf"^train=.* is not allowed: a mapping of train keys.*\(set in {path}\)$"):
        load_config(path, overrides)


def test_a_scalar_section_in_an_included_file_is_refused_under_a_file_that_sets_the_section(tmp_path):
    inner = write(tmp_path / "inner.yaml", "optim: 0.001\n")
    outer = write(tmp_path / "outer.yaml", "include: [inner.yaml]\noptim: {lr: 0.01}\n")
    with pytest.raises(ValueError, match=rf"^optim=0.001 is not allowed: .*\(set in {inner}\)$"):
        load_config(outer)


@pytest.mark.parametrize("override", ["train=5", "train=[1]", "eval='x'"])
def test_a_scalar_section_on_the_command_line_is_refused(override):
    with pytest.raises(ValueError, match=r"is not allowed: a mapping of \w+ keys.*\(set on the command line\)$"):
        load_config(TINY, [override, "train.max_steps=3"])


def test_a_mapping_where_a_value_belongs_is_refused_at_the_key():
    with pytest.raises(ValueError, match=r"^train.seed=\{'a': 1\} is not allowed: an integer \(set on the command"):
        load_config(TINY, ["train.seed={a: 1}"])


def test_an_unknown_section_with_a_scalar_is_named_as_unknown(tmp_path):
    path = write(tmp_path / "run.yaml", "trian: 5\n")
    with pytest.raises(ValueError, match=rf"^unknown section 'trian' in {path}; allowed sections: model, data"):
        load_config(path)


# ---- include: empty lists, empty paths, empty files ------------------------------------------------------------------


def test_an_empty_include_list_includes_nothing(tmp_path):
    path = write(tmp_path / "run.yaml", "include:\ntrain: {seed: 3}\n")
    assert load_config(path).train.seed == 3


@pytest.mark.parametrize("include", ["''", "['']", f"['{TINY}', '']"])
def test_an_empty_include_path_is_named_as_such(tmp_path, include):
    path = write(tmp_path / "run.yaml", f"include: {include}\n")
    with pytest.raises(ValueError, match=rf"^{path}: include=.* is not allowed: a path or a list of paths"):
        load_config(path)


def test_an_empty_file_and_an_include_of_an_empty_file_are_the_defaults(tmp_path):
    empty = write(tmp_path / "empty.yaml", "")
    assert load_config(empty).train.seed == 1111
    assert load_config(write(tmp_path / "run.yaml", "include: empty.yaml\n")).train.seed == 1111


# ---- YAML: merge keys, syntax errors, anchors that hold themselves, nesting ------------------------------------------


def test_yaml_merge_keys_work_as_yaml_defines_them(tmp_path):
    path = write(
        tmp_path / "run.yaml",
        """\
        eval: &every_3 {every: 3}
        checkpoint:
          <<: [*every_3, {keep_last: 5, resume: false}]
          keep_last: 6
        log:
          <<: {every: 7, tensorboard: false}
        """,
    )
    cfg = load_config(path)
    assert cfg.eval.every == 3
    assert (cfg.checkpoint.every, cfg.checkpoint.keep_last, cfg.checkpoint.resume) == (3, 6, False)  # own key wins
    assert (cfg.log.every, cfg.log.tensorboard) == (7, False)


def test_yaml_merge_keys_follow_the_specs_order_where_pyyaml_does_not(tmp_path):
    """yaml.org/type/merge.html: of a list of merged mappings the earlier one wins, the mapping's own keys win over
    all of them, and a merged mapping that merges others is read as its own keys over its merges first. PyYAML's
    safe_load gives the later mapping (every: 9) for the first case."""
    path = write(
        tmp_path / "run.yaml",
        """        eval: &eval {every: 5, max_batches: 4}
        checkpoint:
          <<: [{every: 3}, {every: 9, keep_last: 6}]
        log:
          <<: [{every: 11, tensorboard: false}, {every: 13, tensorboard: true}]
          every: 2
        train:
          <<: {<<: {seed: 1, max_steps: 50}, seed: 7}
        """,
    )
    cfg = load_config(path)
    assert (cfg.checkpoint.every, cfg.checkpoint.keep_last) == (3, 6)  # the earlier mapping of the list
    assert (cfg.log.every, cfg.log.tensorboard) == (2, False)  # the own key, then the earlier mapping
    assert (cfg.train.seed, cfg.train.max_steps) == (7, 50)  # nested: the middle's own seed over its base's
    assert (cfg.eval.every, cfg.eval.max_batches) == (5, 4)
    merged_twice = write(
        tmp_path / "twice.yaml",
        """\
        eval: &every_8 {<<: {every: 1}, every: 8}
        checkpoint: {<<: [*every_8, {every: 6, keep_last: 2}], keep_last: 3}
        log: {<<: [{every: 4}, *every_8]}
        """,
    )
    cfg = load_config(merged_twice)
    assert cfg.eval.every == 8 and (cfg.checkpoint.every, cfg.checkpoint.keep_last) == (8, 3)
    assert cfg.log.every == 4  # an anchor merged a second time: read the same way, after the earlier mapping


def test_a_merge_key_through_an_anchor_of_another_section(tmp_path):
    path = write(tmp_path / "run.yaml", "eval: &e {every: 3, max_batches: 2}\ncheckpoint:\n  <<: *e\n  keep_last: 1\n")
    with pytest.raises(ValueError, match=r"^unknown key 'checkpoint.max_batches' in .*run.yaml"):
        load_config(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("train:\n  seed: 1\n  seed: 2\n", r"duplicate key 'seed' at line 3, column 3$"),
        ("train:\n  <<: {seed: 1}\n  <<: {seed: 2}\n", r"duplicate key '<<' \(a merge key\) at line 3, column 3$"),
        ("train:\n  <<: 5\n", r"expected a mapping .* for merging, but found scalar .* at line 2, column 7$"),
        ("train: {seed: 1\n", r"not valid YAML: .* at line 2, column 1$"),
        ("train: {seed: 1}\x00\n", r"the character U\+0000 at offset 16 is not allowed in YAML"),
    ],
)
def test_bad_yaml_is_one_line_naming_the_file_and_the_place(tmp_path, text, message):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ValueError) as caught:
        load_config(path)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"{path}: not valid YAML")
    assert caught.match(message)


def test_bad_yaml_in_an_override_is_one_line():
    with pytest.raises(ValueError) as caught:
        load_config(TINY, ["train={seed: [1}"])
    assert "\n" not in str(caught.value) and caught.match(r"^override 'train=\{seed: \[1\}': the value is not valid")


@pytest.mark.parametrize(
    "text, key, anchor, place",
    [
        ("checkpoint: &c {every: 2, sub: *c}\n", "checkpoint.sub", "c", "line 1, column 13"),
        ("train: &t\n  seed: 1\n  more: [1, {back: *t}]\n", "train.more[1].back", "t", "line 1, column 8"),
        ("eval: &e [1, *e]\n", "eval[1]", "e", "line 1, column 7"),
        ("model: &m {<<: *m}\n", "model.<<", "m", "line 1, column 8"),
    ],
)
def test_a_yaml_anchor_used_inside_itself_is_one_line_naming_the_file_and_the_key(
    tmp_path, capsys, text, key, anchor, place
):
    """Data that holds itself (an alias inside the node its anchor names) is no config: refused where it is read,
    naming the file, the key and the anchor, not a RecursionError wherever a reader first walks it."""
    from txl_dist.training.startup import parse_run_args

    path = write(tmp_path / "run.yaml", text)
    expected = f"{path}: {key} is an alias of &{anchor} ({place}), which holds it: a config cannot hold itself"
    with pytest.raises(ValueError) as caught:
        load_config(path)
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=rf"^{path}: {re.escape(key)} is an alias .*\(included from .*top.yaml\)$"):
        load_config(write(tmp_path / "top.yaml", "include: [run.yaml]\n"))
    with pytest.raises(SystemExit) as exited:
        parse_run_args(["--config", str(path), "--print-config"], world_size=1, device="cpu")
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(expected + " (write the values out)")


def test_a_recursive_override_or_yaml_nested_too_deeply_is_one_line():
    with pytest.raises(ValueError, match=r"^override 'train.seed=&a \[\*a\]': in the value, \[0\] is an alias of &a"):
        load_config(TINY, ["train.seed=&a [*a]"])
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(
        ValueError, match=r"^override 'train.seed=\[\[\[.*the value is not valid YAML: nested too deeply"
    ):
        load_config(TINY, [f"train.seed={deep}"])


def test_aliases_of_aliases_that_write_out_to_millions_of_values_are_refused_at_once(tmp_path):
    """A "billion laughs": a few lines whose aliases every reader (a copy, an error message) would write out to
    9^12 values; refused where the file is read, naming the file and the key, without expanding it."""
    items = ["&a0 [x, x, x, x, x, x, x, x, x]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 12)]
    path = write(tmp_path / "laughs.yaml", "train:\n  seed: [" + ", ".join(items) + "]\n")
    with pytest.raises(ValueError, match=rf"^{path}: train.seed\[6\] \(line 2, column \d+\) holds more than 1,000,000"):
        load_config(path)


def test_a_config_file_nested_too_deeply_for_pyyaml_is_one_line(tmp_path):
    path = write(tmp_path / "deep.yaml", "train: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n")
    with pytest.raises(ValueError, match=rf"^{path}: not valid YAML: nested too deeply"):
        load_config(path)


# ---- the config file itself: binary, a folder, a device, a BOM, unreadable -------------------------------------------


@pytest.mark.parametrize("as_include", [False, True])
def test_a_binary_config_file_is_named(tmp_path, as_include):
    binary = write(tmp_path / "weights.yaml", bytes(range(128, 256)) * 4)
    path = write(tmp_path / "run.yaml", "include: [weights.yaml]\n") if as_include else binary
    with pytest.raises(ValueError, match=rf"^{binary}: not a text config file.*byte 0x80 at offset 0 is not UTF-8"):
        load_config(path)


def test_a_folder_or_a_utf8_bom_as_config_file(tmp_path):
    with pytest.raises(ValueError, match=rf"^{tmp_path}: a folder, not a config file$"):
        load_config(tmp_path)
    assert load_config(write(tmp_path / "bom.yaml", "\ufefftrain: {seed: 4}\n")).train.seed == 4
    with pytest.raises(ValueError, match=r"^/dev/null: not a regular file \(a device, a pipe, ...\)$"):
        load_config("/dev/null")


def test_an_unreadable_config_file_is_named(tmp_path):
    path = write(tmp_path / "secret.yaml", "train: {seed: 1}\n")
    path.chmod(0)
    if os.access(path, os.R_OK):
        pytest.skip("running as root: every file is readable")
    with pytest.raises(ValueError, match=rf"^{path}: cannot read the config file: Permission denied$"):
        load_config(path)


# ---- the ranges of numbers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seed=99999999999999999999", r"an integer from 0 to 4294967295 \(2\*\*32 - 1\)"),
        ("train.seed=4294967296", r"an integer from 0 to 4294967295"),
        ("train.max_steps=99999999999999999999", rf"an integer from 1 to {INT64_MAX} \(2\*\*63 - 1"),
        ("train.global_batch=9223372036854775808", rf"an integer from 1 to {INT64_MAX}"),
        ("train.micro_batch=99999999999999999999", rf"an integer from 1 to {INT64_MAX} .*, or null"),
        ("checkpoint.every=99999999999999999999", rf"an integer from 0 to {INT64_MAX}"),
        ("zero.bucket_size=99999999999999999999", rf"an integer from 1 to {INT64_MAX}"),
        ("eval.clamp_len=-99999999999999999999", rf"an integer from -{INT64_MAX + 1} to {INT64_MAX}"),
        ("model.n_layer=99999999999999999999", rf"an integer from 1 to {INT64_MAX}"),
        ("model.n_token=4294967297", r"an integer from 1 to 4294967296 \(2\*\*32\)"),
        ("model.cutoffs=[20, 99999999999999999999]", rf"a list of integers, each <= {INT64_MAX}"),
        ("precision.initial_scale_power=1000", r"an integer from 0 to 127"),
        ("train.seed=-1", r"an integer >= 0"),
        ("train.max_steps=2.0", r"an integer"),
        ("train.max_steps=1e3", r"an integer"),
        ("train.max_steps=true", r"an integer"),
        ("optim.lr=true", r"a finite number"),
        ("optim.lr=.nan", r"a finite number"),
        ("optim.lr=1e400", r"a finite number"),
        ("optim.lr=-.inf", r"a finite number"),
        ("train.peak_tflops=0", r"a positive number, or null"),
        ("train.peak_tflops=-989.5", r"a positive number, or null"),
        ("train.peak_tflops=.inf", r"a finite number"),
        ("train.peak_tflops=1e-300", r"a positive number, or null: from 0.001 TFLOPS"),  # an MFU of 4e+296 %
        ("train.peak_tflops=1e9", r"a positive number, or null: from 0.001 TFLOPS"),
    ],
)
def test_an_integer_or_number_out_of_the_range_the_code_needs_is_refused_at_config_time(override, message):
    key = override.partition("=")[0]
    with pytest.raises(ValueError, match=rf"^{key}=.+? is not allowed: {message}.*\(set on the command line\)$"):
        load_config(TINY, [override])


def test_the_largest_values_allowed_are_accepted():
    cfg = load_config(TINY, ["train.seed=4294967295", "train.max_steps=9223372036854775807"])
    assert (cfg.train.seed, cfg.train.max_steps) == (2**32 - 1, INT64_MAX)
    torch.manual_seed(cfg.train.seed + 1_000_003 * 4095 + 7919 * 10**9)  # what the trainer seeds, late in a run


def test_a_seed_too_large_stops_the_launcher_in_one_line_with_status_2(tmp_path, capsys):
    from txl_dist.training.startup import parse_run_args

    path = write(tmp_path / "run.yaml", f"include: [{TINY}]\ntrain: {{seed: 99999999999999999999}}\n")
    with pytest.raises(SystemExit) as exited:
        parse_run_args(["--config", str(path), "--print-config"], world_size=1, device="cpu")
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(
        f"train.seed=99999999999999999999 is not allowed: an integer from 0 to 4294967295 (2**32 - 1) (set in {path})"
    )
