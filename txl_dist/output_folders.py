"""Outputs that never destroy an input: a conversion's or a tool's output folder is checked before any work
(`check_output_path`: not an input, not inside one, not a folder of files this project did not write), written into
a staging folder beside it and moved into place whole (`staged_output`, `publish_directory`), so that an interrupt
or a failure leaves either the old folder or the whole new one."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from txl_dist.fileio import dangling_link, ensure_directory, make_temporary_directory, with_path

OUTPUT_MARKER = ".txl_dist-output"
"""Left in every folder a txl_dist conversion writes: ``overwrite`` replaces only an empty folder or one holding it."""


class OutputPathError(ValueError):
    """An output path that would destroy an input or files this tool did not write; the message names both."""


def refuse_output_over_inputs(output: str | os.PathLike, inputs: Sequence[str | os.PathLike]) -> None:
    """OutputPathError, before any work, for an output that is one of ``inputs``, contains one (a file or folder
    inside it) or lies inside one (symbolic links followed): writing or replacing it would destroy that input."""
    given = Path(output)
    out = given.resolve()
    for source in inputs:
        source_path = Path(source).resolve()
        if out == source_path:
            raise OutputPathError(f"output {given} is the input {source}: choose another output")
        if out in source_path.parents:
            raise OutputPathError(
                f"output {given} contains the input {source}: replacing it would delete the "
                f"input; choose another output"
            )
        if source_path in out.parents:
            raise OutputPathError(f"output {given} lies inside the input {source}: choose an output outside it")


def check_output_path(
    output: str | os.PathLike, inputs: Sequence[str | os.PathLike] = (), *, overwrite: bool, directory: bool = True
) -> Path:
    """Refuse, before any work, an output that would lose data; return it.

    Refused: an output that is one of ``inputs``, contains one, or lies inside one (symbolic links followed); a
    dangling symbolic link; an existing output without ``overwrite``; with ``overwrite``, a folder that is neither
    empty nor marked with `OUTPUT_MARKER` (so unrelated files are never deleted), or a file where a folder is
    expected and the reverse.
    """
    given = Path(output)
    refuse_output_over_inputs(given, inputs)
    target = dangling_link(given)
    if target is not None:
        raise OutputPathError(
            f"{given}: a symbolic link to {target}, which leads nowhere: remove the link or choose another output"
        )
    if not given.exists():
        return given
    if not overwrite:
        raise OutputPathError(f"{given}: already exists (pass --overwrite to replace it)")
    if not directory:
        if given.is_dir():
            raise OutputPathError(f"{given}: is a folder; the output is a file")
        return given
    if not given.is_dir():
        raise OutputPathError(f"{given}: is a file; --overwrite replaces only a folder this tool wrote")
    if any(given.iterdir()) and not (given / OUTPUT_MARKER).is_file():
        raise OutputPathError(
            f"{given}: holds files this tool did not write (no {OUTPUT_MARKER}); --overwrite "
            f"replaces only an empty folder or one written by txl_dist: remove it yourself or "
            f"choose another output"
        )
    return given


def mark_output(directory: str | os.PathLike, description: str) -> None:
    """Leave `OUTPUT_MARKER` in a folder being written (its staging copy), naming what wrote it."""
    Path(directory, OUTPUT_MARKER).write_text(json.dumps({"written_by": description}) + "\n", encoding="utf-8")


def copy_tree(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Copy a folder as new files and folders (the modes the umask gives; ``shutil.copytree`` copies the modes)."""
    Path(destination).mkdir()
    for item in sorted(Path(source).iterdir()):
        (copy_tree if item.is_dir() else shutil.copyfile)(item, Path(destination) / item.name)


@contextmanager
def staged_output(out_dir: str | os.PathLike, written_by: str) -> Iterator[Path]:
    """A folder to write ``out_dir``'s files into: a staging folder beside it, marked as ours (``written_by``)
    and moved into place by `publish_directory` when the block ends, or removed on any error or interrupt, so
    that ``out_dir`` is either the old folder or the whole new one. An OSError on a path inside the staging
    folder is raised naming ``out_dir`` (the staging name means nothing to a user); others pass unchanged."""
    out_dir = Path(out_dir)
    made: list[Path] = []
    try:
        ensure_directory(out_dir.parent)
        staging = make_temporary_directory(out_dir.parent, f".{out_dir.name}.", made=made)
    except OSError as error:
        raise with_path(error, out_dir, replace=True) from error
    except BaseException:  # Ctrl-C just after the staging folder was made: it goes too
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        yield staging
        mark_output(staging, written_by)
        publish_directory(staging, out_dir)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError) and str(error.filename or staging).startswith(str(staging)):
            raise with_path(error, out_dir, replace=True) from error  # ours, not an input's
        raise


def publish_directory(staging: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Move a finished staging folder to ``output`` (same parent), replacing an old one as late as possible: the
    old folder is moved aside before the new one takes its name, then deleted."""
    staging, output = Path(staging), Path(output)
    if not output.exists():
        os.replace(staging, output)
        return output
    made: list[Path] = []
    try:
        aside = make_temporary_directory(output.parent, f".{output.name}.", ".old", made=made)
    except BaseException:  # an interrupt just after the mkdir: the empty folder goes too
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        raise
    os.replace(output, aside / output.name)
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(aside / output.name, output)
        aside.rmdir()
        raise
    shutil.rmtree(aside)
    return output
