"""What the data tools' command lines share: one-line usage errors, the flags a user gave, the exit statuses (those
of every command, `txl_dist.exit_status`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from txl_dist.exit_status import FAILURE, INTERRUPTED, USAGE_ERROR, error_line

if TYPE_CHECKING:
    from data_tools.corpora.inputs import InputFile

__all__ = ["FAILURE", "INTERRUPTED", "USAGE_ERROR", "OneLineParser", "describe_inputs", "flag_name", "given_flags"]
# The statuses are those of every command (txl_dist.exit_status), named here too for the data tools.


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``NAME: error: MESSAGE`` with exit status 2, as every other
    refusal of these commands (argparse prints its usage first; ``--help`` still shows it)."""

    def __init__(self, *args, name: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = name

    def error(self, message: str) -> None:
        self.exit(USAGE_ERROR, error_line(self.name, message) + "\n")


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations of the options that ``argv`` itself sets (not defaults, nor a preset's): parsed again
    with every default suppressed, so that only what the command line holds lands in the namespace."""
    saved = [(action, action.default) for action in parser._actions]
    saved_defaults = parser._defaults
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        parser._defaults = {}
        namespace, _ = parser.parse_known_args(argv)
    finally:
        parser._defaults = saved_defaults
        for action, default in saved:
            action.default = default
    return set(vars(namespace))


def flag_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """The long option of a destination, as the user types it (``held_out_bytes`` -> ``--held-out-bytes``)."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return dest


def describe_inputs(files: Sequence[InputFile]) -> str:
    """The input files, as a summary line names them: the one file (and the member of a zip archive that was
    read), or how many files there were and the first of them."""
    names = list(dict.fromkeys(f.name + (f" (its member {f.member})" if f.member else "") for f in files))
    if len(names) == 1:
        return names[0]
    return f"{len(names)} files ({names[0]}, ...)" if names else "no file"
