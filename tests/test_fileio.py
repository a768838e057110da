"""txl_dist.fileio.atomic_write: the old file or the whole new one, never a part, and no temporary file left."""

from __future__ import annotations

import os
import stat

import pytest

from txl_dist import fileio


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
