"""Reading the run config's YAML files and ``key.path=value`` overrides into plain data, with where each key path was
set: includes (resolved relative to the including file, cycles refused), mappings merged key by key."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

COMMAND_LINE = "on the command line"


def read_layers(
    paths: str | os.PathLike | Sequence[str | os.PathLike] | None, overrides: Sequence[str] = ()
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each file in ``paths`` (with its includes) merged left to right, then the overrides; and for every key path
    where it was last set (``in configs/x.yaml``, ``on the command line``)."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for path in paths:
        data, data_sources = _read_config_file(Path(path), ())
        merge_mappings(merged, data)
        sources.update(data_sources)
    for override in overrides:
        data = _parse_override(override)
        merge_mappings(merged, data)
        sources.update({path: COMMAND_LINE for path in key_paths(data)})
    return merged, sources


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_config_file(path: Path, including: tuple[Path, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    """A file's data merged over its includes, and where each key path was set."""
    shown = os.path.normpath(path)
    resolved = path.resolve()
    if resolved in including:
        chain = " -> ".join([os.path.normpath(p) for p in including] + [shown])
        raise ValueError(f"include cycle: {chain}")
    if not path.is_file():
        parent = f" (included from {os.path.normpath(including[-1])})" if including else ""
        raise ValueError(f"{shown}: no such config file{parent}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"{shown}: not valid YAML: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{shown}: the top level must be a mapping of sections, got {type(data).__name__}")
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(item, str) for item in includes):
        raise ValueError(
            f"{shown}: include={includes!r} is not allowed: a path or a list of paths (relative to {shown})"
        )
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in includes:
        included, included_sources = _read_config_file(path.parent / item, including + (resolved,))
        merge_mappings(merged, included)
        sources.update(included_sources)
    merge_mappings(merged, data)
    sources.update({key: f"in {shown}" for key in key_paths(data)})
    return merged, sources


def _parse_override(text: str) -> dict[str, Any]:
    """``section.key=value`` (value read as YAML) as nested data; a whole section may be given as a mapping."""
    key, sep, raw_value = text.partition("=")
    parts = key.split(".")
    if not sep or not all(parts) or len(parts) > 2:
        raise ValueError(f"override {text!r} is not section.key=value (e.g. train.max_steps=100)")
    try:
        value = yaml.safe_load(raw_value)
    except yaml.YAMLError as error:
        raise ValueError(f"override {text!r}: the value is not valid YAML: {error}") from None
    return {parts[0]: value} if len(parts) == 1 else {parts[0]: {parts[1]: value}}


def merge_mappings(into: dict[str, Any], data: dict[str, Any]) -> None:
    """Merge ``data`` over ``into`` in place: mappings key by key, any other value replaces (a copy of it)."""
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge_mappings(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def key_paths(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key path in nested data, mappings included (``train``, ``train.max_steps``)."""
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        paths.append(path)
        if isinstance(value, dict):
            paths.extend(key_paths(value, path + "."))
    return paths
