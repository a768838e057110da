"""txl_dist.fileio and txl_dist.output_folders: atomic writes (the old file or the whole new one, never a part,
no temporary left), staged output folders, and the modes of every written file and folder."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from txl_dist import fileio, output_folders


def test_a_new_file_gets_the_mode_open_would_give_it(tmp_path):
    old_umask = os.umask(0o027)
    try:
        fileio.atomic_write_text(tmp_path / "a.json", "{}\n")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "a.json").read_text() == "{}\n"
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    target.write_text("old")

    def half_then_fail(handle):
        handle.write(b"new, but only ha")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fileio.atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_an_interrupt_just_after_the_temporary_is_created_leaves_nothing_behind(tmp_path, monkeypatch):
    # Ctrl-C can land after os.open created the file and before its descriptor was stored.
    target = tmp_path / "state.json"
    target.write_text("old")
    real_open = os.open

    def open_then_interrupt(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if str(path).startswith(str(tmp_path)):
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    monkeypatch.setattr(fileio.os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fileio.atomic_write_text(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_temporary_name_taken_by_somebody_else_is_skipped_and_kept(tmp_path, monkeypatch):
    names = iter(["taken", "free"])
    monkeypatch.setattr(fileio.secrets, "token_hex", lambda _: next(names))
    (tmp_path / ".out.txt.taken.tmp").write_text("not ours")
    fileio.atomic_write_text(tmp_path / "out.txt", "ours")
    assert (tmp_path / "out.txt").read_text() == "ours"
    assert (tmp_path / ".out.txt.taken.tmp").read_text() == "not ours"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.txt.taken.tmp", "out.txt"]


# --- the modes of written files -------------------------------------------------------------------------------------


def _write_every_output(text: Path, out: Path) -> None:
    """Each writer of txl_dist's outputs, through its command line where it has one."""
    from data_tools import build_shards, train_tokenizer
    from launchers import convert
    from txl_dist.convert.original import save_original, to_original_state_dict
    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset
    from txl_dist.tokenizer import load_tokenizer
    from txl_dist.training.run_dir import RunDirectory

    quiet = ["--no-progress"]
    assert train_tokenizer.main(["--kind", "word", "--input", str(text), "--output", str(out / "words"), *quiet]) == 0
    pieces = ["--kind", "sentencepiece", "--vocab-size", "30", "--input", str(text), "--output", str(out / "pieces")]
    assert train_tokenizer.main(pieces + quiet) == 0
    shards = ["--tokenizer", str(out / "words"), "--output", str(out / "shards"), "--split", f"train={text}"]
    assert build_shards.main(shards + ["--holdout", "valid=0.2", *quiet]) == 0
    tokenizer = load_tokenizer(out / "words")
    config = preset("tiny", n_token=tokenizer.vocab_size, cutoffs=[])
    model = TransformerXLLM(config)
    write_export(model, config, out / "export", tokenizer_dir=out / "words")
    assert convert.main(["export-to-hf", str(out / "export"), str(out / "hf")]) == 0
    assert convert.main(["export-to-hf", str(out / "export"), str(out / "hf"), "--overwrite"]) == 0
    original = out / "original" / "model.pt"
    save_original(to_original_state_dict(model.state_dict(), config), original)
    config_json = str(out / "export" / "config.json")
    command = ["original-to-export", str(original), config_json, str(out / "from_original")]
    assert convert.main([*command, "--tokenizer", str(out / "words")]) == 0
    RunDirectory(out / "run", None).keep_tokenizer(tokenizer.fingerprint, [out / "pieces", out / "words"])


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_every_writer_gives_its_files_and_folders_the_modes_the_umask_gives(tmp_path, umask):
    words = [f"{a}{b}" for a in "bcdfghklmnprst" for b in "aeiou"]
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"{' '.join(words[i % 61 :: 7])} .\n" for i in range(300)))
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777 & ~umask)
    # In this process (a subprocess would start torch again): nothing else runs while the umask is changed.
    old_umask = os.umask(umask)
    try:
        _write_every_output(text, out)
    finally:
        os.umask(old_umask)
    wrong = []
    for path in sorted(out.rglob("*")):
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        if stat.S_IMODE(path.lstat().st_mode) != want:
            wrong.append(f"{path.relative_to(out)} {oct(stat.S_IMODE(path.lstat().st_mode))} != {oct(want)}")
    assert not wrong
    written = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert {"export/model.safetensors", "hf/tokenizer/tokenizer.json", "run/tokenizer/tokenizer.json"} <= written
    assert {"shards/manifest.json", "from_original/model.safetensors", "pieces/tokenizer.json"} <= written


def test_ctrl_c_just_after_the_staging_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """The interrupt that lands between the staging folder's mkdir and the start of the block (where a loaded
    machine put a real Ctrl-C of `convert.py export-to-hub`) removes the folder too: nothing is left beside the
    output."""
    made = []
    mkdir = Path.mkdir

    def mkdir_then_interrupted(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if self.name.startswith(".out."):  # the staging folder, not the parent that ensure_directory makes
            made.append(self)
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupted)
    with pytest.raises(KeyboardInterrupt), output_folders.staged_output(tmp_path / "out", "test"):
        pytest.fail("the block ran")
    monkeypatch.undo()
    assert made and made[0].parent == tmp_path
    assert list(tmp_path.iterdir()) == []
