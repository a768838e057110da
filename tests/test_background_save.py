"""txl_dist.checkpoints.background: the host copy that a background save takes, and the thread that writes it
(the whole save under DeepSpeed, killed while in flight and resumed: tests/test_train_launcher.py)."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch

from txl_dist.checkpoints import weights_only
from txl_dist.checkpoints.background import BackgroundWrite, FileJob, HostBuffers, host_copy, torch_save_job
from txl_dist.fileio import file_checksum


def test_the_host_copy_is_fixed_when_taken_whatever_training_does_next():
    weights = torch.arange(6, dtype=torch.float32)
    view = weights[2:4]  # a view: its copy must not carry the rest of the storage
    state = {"module": OrderedDict(w=weights, v=view), "opt": [{"step": 3, "exp_avg": weights * 2}], "tag": ("a", 1)}
    copied = host_copy(state)
    weights.add_(100.0)
    state["opt"][0]["step"] = 4
    assert torch.equal(copied["module"]["w"], torch.arange(6, dtype=torch.float32))
    assert torch.equal(copied["module"]["v"], torch.tensor([2.0, 3.0]))
    assert copied["module"]["v"].untyped_storage().nbytes() == 8
    assert isinstance(copied["module"], OrderedDict) and copied["opt"][0]["step"] == 3 and copied["tag"] == ("a", 1)


def test_the_thread_writes_each_file_atomically_with_the_checksum_of_its_bytes(tmp_path):
    state = {"w": torch.randn(64, 64), "step": 7}
    write = BackgroundWrite([torch_save_job(str(tmp_path / "a.pt"), host_copy(state))]).start()
    write.wait()
    assert write.error is None and not write.running and write.seconds > 0
    path = os.path.abspath(tmp_path / "a.pt")
    assert write.written == {path: file_checksum(path)}
    loaded = weights_only.load(path)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]  # no temporary left
    assert write.jobs == []  # the host copies are let go once written


def test_a_write_that_fails_is_an_error_naming_the_file_and_leaves_no_part_of_it(tmp_path):
    def fail_midway(handle):
        handle.write(b"x" * 1000)
        raise OSError(28, "No space left on device")

    target = tmp_path / "b.pt"
    write = BackgroundWrite([FileJob(str(target), fail_midway), torch_save_job(str(tmp_path / "c.pt"), {})]).start()
    write.wait()
    assert isinstance(write.error, OSError) and str(target) in str(write.error), write.error
    assert list(tmp_path.iterdir()) == []  # neither the failed file nor its temporary, nor the files after it
    with pytest.raises(OSError, match="No space left on device"):
        raise write.error


def test_the_next_save_copies_into_the_buffers_of_the_last_one():
    """A background save after the first one copies into the host tensors it kept (no fresh memory to allocate
    and zero), and still holds the state as it is at that save."""
    buffers = HostBuffers()
    weights = torch.arange(4, dtype=torch.float32)
    first = host_copy({"module": {"w": weights}, "step": 1}, buffers, ("model.pt",))
    weights.add_(1.0)
    second = host_copy({"module": {"w": weights}, "step": 2}, buffers, ("model.pt",))
    assert second["module"]["w"] is first["module"]["w"]  # the same buffer, refilled
    assert torch.equal(second["module"]["w"], torch.arange(1, 5, dtype=torch.float32)) and second["step"] == 2
    other = host_copy({"module": {"w": weights}}, buffers, ("optim.pt",))
    assert other["module"]["w"] is not first["module"]["w"]  # another file, another buffer
    grown = host_copy({"module": {"w": torch.zeros(8)}}, buffers, ("model.pt",))
    assert grown["module"]["w"].shape == (8,)  # a new shape gets a new buffer
