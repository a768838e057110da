"""Bad input to launchers/train.py's command line (parse_run_args and require_memory_fits, in this process): what
a run needs is checked before any process group starts. The shards (a missing eval split, a dangling link), the output
folder (read-only, immutable, a dangling link; txl_dist.fileio's description of the link), the memory plan, and a
configuration error under a launcher, printed once per node."""

from __future__ import annotations

import pytest

from data_tools import build_shards
from tests.bad_input.helpers import TINY, _parse_run
from tests.conftest import ptb_sentences
from tests.test_run_integrity import _read_only, small_tmpfs  # noqa: F401 -- a 2 MB tmpfs fixture (root)

# ---- the shards: a missing eval split, a dangling symbolic link as data.shards ---------------------------------------


def test_a_missing_eval_split_is_refused_before_the_run_starts(ptb_word_tokenizer, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(line + "\n" for line in ptb_sentences("valid")[:200]))
    shards = tmp_path / "shards"
    assert (
        build_shards.main(
            [
                "--tokenizer",
                str(ptb_word_tokenizer),
                "--output",
                str(shards),
                "--split",
                f"train={text}",
                "--holdout",
                "test=0.1",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        _parse_run(f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}")
    assert stopped.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"eval.split='valid': {shards / 'manifest.json'} has no such split (it has "
        f"['test', 'train']); build it (data_tools.build_shards --split or "
        f"--holdout) or set eval.split\n"
    )
    _parse_run(f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}", "eval.split=test")
    assert not (tmp_path / "run").exists()


def test_a_dangling_symbolic_link_as_data_shards_is_named(tmp_path, capsys):
    from txl_dist.data import read_manifest
    from txl_dist.training.startup import parse_run_args

    link = tmp_path / "shards"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=rf"^{link}: a symbolic link to {tmp_path / 'gone'}, which leads nowhere"):
        read_manifest(link)  # evaluate.py --shards, inspect_shards (was: 'rerun build_shards with --resume')
    argv = ["--config", str(TINY), f"data.shards={link}", f"train.output_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit):
        parse_run_args(argv, world_size=1, device="cpu")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"data.shards={str(link)!r}: a symbolic link to {tmp_path / 'gone'}, which leads nowhere")


# ---- train.output_dir: read-only, immutable, a dangling symbolic link ------------------------------------------------


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_run_starts(small_shards, small_tmpfs, capsys):  # noqa: F811
    """A read-only output is a failure of the surroundings (status 1, docs/architecture.md: Rules): one line."""
    _read_only(small_tmpfs)
    with pytest.raises(SystemExit) as stopped:
        _parse_run(f"data.shards={small_shards}", f"train.output_dir={small_tmpfs / 'runs' / 'a'}")
    assert stopped.value.code == 1
    assert capsys.readouterr().err.endswith(
        f"train.output_dir='{small_tmpfs / 'runs' / 'a'}': cannot write in {small_tmpfs}: read-only file system\n"
    )


def test_an_immutable_run_folder_is_a_failure_with_one_line(small_shards, tmp_path, capsys):
    """``chattr +i`` refuses even root (the campaign's read-only run folder): status 1, as for a read-only mount."""
    import subprocess

    run = tmp_path / "run"
    run.mkdir()
    if subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        with pytest.raises(SystemExit) as stopped:
            _parse_run(f"data.shards={small_shards}", f"train.output_dir={run}")
    finally:
        subprocess.run(["chattr", "-i", str(run)], check=True)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"launchers/train.py: error: train.output_dir='{run}': cannot write in {run}: operation not permitted"
    )


@pytest.mark.parametrize("folder", ["checkpoints", "tensorboard"])
def test_an_immutable_folder_the_run_writes_later_is_refused_at_the_start(small_shards, tmp_path, capsys, folder):
    """The audit's neighbour: a resumed run whose checkpoints/ refused writes trained until its first save, then
    ended with DeepSpeed's misleading 'no such file or directory' (permission denied swallowed)."""
    import subprocess

    run = tmp_path / "run"
    (run / folder).mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(run / folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        with pytest.raises(SystemExit) as stopped:
            _parse_run(f"data.shards={small_shards}", f"train.output_dir={run}")
    finally:
        subprocess.run(["chattr", "-i", str(run / folder)], check=True)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"launchers/train.py: error: train.output_dir='{run}': cannot write in {run / folder}: operation not permitted"
    )


@pytest.mark.parametrize("where", ["itself", "its parent"])
def test_a_dangling_symbolic_link_as_output_dir_is_named_before_anything_starts(
    tmp_path, capsys, where, ptb_word_shards
):
    from txl_dist.training.startup import parse_run_args

    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "elsewhere" / "runs")
    output_dir = link if where == "itself" else link / "tiny"
    argv = ["--config", str(TINY), f"data.shards={ptb_word_shards}", f"train.output_dir={output_dir}"]
    with pytest.raises(SystemExit) as exited:
        parse_run_args(argv, world_size=1, device="cpu")
    assert exited.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(
            f"train.output_dir={str(output_dir)!r}: {link} is a symbolic link to {tmp_path / 'elsewhere' / 'runs'}, "
            f"which leads nowhere: create its target or remove the link"
        )
    )


def test_making_a_folder_at_a_dangling_link_says_so(tmp_path):
    from txl_dist.fileio import describe_os_error, ensure_directory

    link = tmp_path / "out"
    link.symlink_to("missing")
    for path in (link, link / "sub"):
        with pytest.raises(FileExistsError) as caught:
            ensure_directory(path)
        assert describe_os_error(caught.value) == (
            f"{link}: a symbolic link to missing, which leads nowhere: create its target or remove the link"
        )


# ---- the memory plan -------------------------------------------------------------------------------------------------


def test_a_memory_plan_over_the_device_is_refused_before_the_run_starts(small_shards, tmp_path):
    from txl_dist.plan import MiB, plan_memory
    from txl_dist.plan.report import require_memory_fits

    cfg, _ = _parse_run(f"data.shards={small_shards}", f"train.output_dir={tmp_path / 'run'}")
    with pytest.raises(
        ValueError,
        match=r"micro-batch 2: the memory plan needs 0.\d\d GiB per rank, the cuda device "
        r"has 0.06 GiB; no micro-batch fits: .*train.memory_check=false starts anyway",
    ):
        require_memory_fits(cfg, 2, "cuda", 64 * MiB)
    one = plan_memory(cfg, 2, 1, "cuda").needed()
    assert one < plan_memory(cfg, 2, 2, "cuda").needed()
    with pytest.raises(ValueError, match=r"train.micro_batch=1 \(4 accumulation steps\) fits"):
        require_memory_fits(cfg, 2, "cuda", one)
    require_memory_fits(cfg, 2, "cuda", 80 * 1024 * MiB)
    cfg.train.memory_check = False
    require_memory_fits(cfg, 2, "cuda", 64 * MiB)


# ---- a configuration error under a launcher is printed once, by the first rank of the node ---------------------------


def test_a_configuration_error_is_printed_by_the_first_rank_of_a_node_only(small_shards, tmp_path, monkeypatch, capsys):
    for local_rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as stopped:
            _parse_run(f"data.shards={small_shards}", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=0")
        assert stopped.value.code == 2
        error = capsys.readouterr().err
        assert ("train.max_steps" in error) == printed and (error == "") != printed
