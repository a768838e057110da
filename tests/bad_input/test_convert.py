"""Bad input to launchers/convert.py (txl_dist.convert): hf-to-export given a crafted pickle or a truncated
safetensors file, original-to-export given a truncated state dict, a folder or a zip archive, an output at a
dangling symbolic link, and Ctrl-C during a conversion."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tests.bad_input.helpers import _last_line_only, _one_line, _signalled_in_process
from tests.launcher import in_process
from txl_dist.export import write_export
from txl_dist.model import TransformerXLLM, preset

# ---- hf-to-export: a crafted pickle, a truncated safetensors file ----------------------------------------------------


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_hf_to_export_refuses_a_crafted_pickle_and_a_truncated_file_in_one_line(ptb_export, tmp_path):
    hf = tmp_path / "hf"
    in_process("launchers/convert.py", "export-to-hf", str(ptb_export), str(hf))
    weights = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    _one_line(
        in_process("launchers/convert.py", "hf-to-export", str(hf), str(tmp_path / "a"), check=False),
        "model.safetensors",
        "not a readable safetensors file",
    )

    (hf / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    with open(hf / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"crit.cluster_weight": _RunsCode(marker)}, handle, protocol=2)
    _one_line(
        in_process("launchers/convert.py", "hf-to-export", str(hf), str(tmp_path / "b"), check=False),
        "pytorch_model.bin",
        "refused to unpickle",
    )
    assert not marker.exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- original-to-export: a truncated state dict, a folder or a zip archive, an output at a dangling link -------------


@pytest.mark.parametrize("kept", [0, 10, 0.5, -100])
def test_a_truncated_original_state_dict_is_named_by_original_to_export(tmp_path, capsys, kept):
    from launchers import convert
    from txl_dist.convert.original import save_original, to_original_state_dict
    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset

    config = preset("tiny")
    model = TransformerXLLM(config)
    write_export(model, config, tmp_path / "export")
    save_original(to_original_state_dict(model.state_dict(), config), tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    size = int(len(data) * kept) if isinstance(kept, float) else kept % len(data)
    (tmp_path / "truncated.pt").write_bytes(data[:size])
    argv = ["original-to-export", str(tmp_path / "truncated.pt"), str(tmp_path / "export" / "config.json")]
    assert convert.main([*argv, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        f"convert.py original-to-export: error: {tmp_path / 'truncated.pt'}: not a readable torch checkpoint "
        f"({size:,} bytes): truncated, damaged or not written by torch.save (torch.load: "
    )
    assert not (tmp_path / "out").exists()


def test_a_folder_or_a_zip_archive_given_as_the_original_state_dict_is_named(tmp_path):
    import zipfile

    from txl_dist.convert.original import load_original

    with pytest.raises(ValueError, match=rf"^{tmp_path}: a folder, not a state dict file"):
        load_original(tmp_path)
    with zipfile.ZipFile(tmp_path / "archive.pt", "w") as archive:
        archive.writestr("readme.txt", "not a checkpoint")
    with pytest.raises(ValueError, match=r"archive.pt: not a readable torch checkpoint \(.* bytes\): .*torch.load: "):
        load_original(tmp_path / "archive.pt")


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_conversion_into_a_dangling_symbolic_link_names_it(tmp_path, capsys, overwrite):
    from launchers import convert

    state = tmp_path / "model.pt"
    torch.save({}, state)
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    argv = ["original-to-export", str(state), str(tmp_path / "config.json"), str(tmp_path / "out"), *overwrite]
    assert convert.main(argv) == 2
    assert capsys.readouterr().err == (
        f"convert.py original-to-export: error: {tmp_path / 'out'}: a symbolic link to {tmp_path / 'gone'}, which "
        f"leads nowhere: remove the link or choose another output\n"
    )


# ---- Ctrl-C ----------------------------------------------------------------------------------------------------------


def test_ctrl_c_during_convert_leaves_no_output_and_no_staging_folder(tmp_path):
    # 15M parameters: the weights take long enough to write that the interrupt lands while the folder is staged.
    torch.manual_seed(0)
    model = TransformerXLLM(preset("tiny", d_model=512, d_inner=2048, n_head=8, d_head=64, n_layer=4, d_embed=512))
    export = write_export(model, model.config, tmp_path / "export")
    output = tmp_path / "hub"
    status, _, stderr = _signalled_in_process(
        "launchers/convert.py",
        ["export-to-hub", str(export), str(output)],
        lambda out, err: any(path.name.startswith(".hub.") for path in tmp_path.iterdir()),
    )
    assert status == 130
    _last_line_only(stderr, "convert.py: interrupted; no output written (an existing one is left as it was)")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export"]
