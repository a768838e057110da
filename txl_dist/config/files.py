"""Reading the run config's YAML files and ``key.path=value`` overrides into plain data, with where each key path was
set: includes (resolved relative to the including file, cycles refused), mappings merged key by key.

Each layer (a file, an override) is checked as it is read, so that no later layer can hide its mistakes: a section
must be a mapping of keys, or empty (``train:`` with every key commented out reads as null, and means that the
layer changes nothing in that section); YAML's merge keys (``<<: *anchor``) are read as YAML defines them, and a
key written twice in one mapping, an anchor used inside its own value (data that holds itself), aliases of aliases
that write out to millions of values, and nesting too deep for PyYAML are refused. Errors are one line naming the
file (or the override) and the key."""

from __future__ import annotations

import copy
import os
from collections.abc import Collection, Hashable, Sequence
from pathlib import Path
from typing import Any

import yaml

from txl_dist.config.fields import ConfigError

COMMAND_LINE = "on the command line"


def read_layers(
    paths: str | os.PathLike | Sequence[str | os.PathLike] | None,
    overrides: Sequence[str] = (),
    sections: Collection[str] = (),
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each file in ``paths`` (with its includes) merged left to right, then the overrides; and for every key path
    where it was last set (``in configs/x.yaml``, ``on the command line``). A value of one of ``sections`` that is
    neither a mapping nor null raises ConfigError naming the file and the key; a null section is dropped."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for path in paths:
        data, data_sources = _read_config_file(Path(path), (), sections)
        merge_mappings(merged, data)
        sources.update(data_sources)
    for override in overrides:
        data = _sections_of(_parse_override(override), sections, COMMAND_LINE)
        merge_mappings(merged, data)
        sources.update({path: COMMAND_LINE for path in key_paths(data)})
    return merged, sources


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML would keep the last silently) and merges as
    the YAML merge key's spec (yaml.org/type/merge.html) says: a mapping's own keys override the merged ones, and
    of a list of merged mappings the earlier one wins (PyYAML's own lets the later win). The keys that a merge key
    (``<<``) brings in are not repeats."""

    def __init__(self, stream):
        super().__init__(stream)
        self._flattened: set[int] = set()
        """The mapping nodes whose merge keys are resolved (by id: the nodes live as long as the loader)."""
        self._anchor_names: dict[int, str] = {}
        """The anchor (``&name``) of each anchored node, by id, for `RecursiveYAML`'s message."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        anchor = None if isinstance(event, yaml.AliasEvent) else event.anchor
        node = super().compose_node(parent, index)
        if anchor is not None:
            self._anchor_names[id(node)] = anchor
        return node

    def construct_document(self, node):
        """The document's data, once its nodes are known to form a tree of a config's size: an alias inside the
        anchored node that it names (``&c {sub: *c}``, ``&m {<<: *m}``) would make the data hold itself, which no
        config means and whose every reader would recurse without end; aliases of aliases (a "billion laughs")
        are a few lines that every reader (a copy, an error message's repr) would expand to billions of values."""
        self._refuse_recursion(node, [], set(), {})
        return super().construct_document(node)

    def _refuse_recursion(self, node: yaml.Node, path: list[str], holders: set[int], sizes: dict[int, int]) -> int:
        """How many values ``node`` (at key ``path``) holds with its aliases written out; RecursiveYAML when it
        or a node within it is one of ``holders``, the nodes that hold it, or when it holds more than
        `MAX_VALUES`. ``sizes``: the nodes walked already (each node is walked once, however many aliases name
        it), with their counts."""
        if id(node) in holders:
            raise RecursiveYAML(".".join(path) or "the top level", self._anchor_names.get(id(node)), node.start_mark)
        if isinstance(node, yaml.ScalarNode):
            return 1
        if id(node) in sizes:
            return sizes[id(node)]
        holders.add(id(node))
        size = 1
        if isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                where = [*path[:-1], f"{path[-1]}[{index}]"] if path else [f"[{index}]"]
                size += self._refuse_recursion(item, where, holders, sizes)
        else:
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG:
                    key = "<<"
                else:
                    key = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                    size += self._refuse_recursion(key_node, [*path, key], holders, sizes)
                size += self._refuse_recursion(value_node, [*path, key], holders, sizes)
        if size > MAX_VALUES:
            raise TooLargeYAML(".".join(path) or "the top level", node.start_mark)
        holders.discard(id(node))
        sizes[id(node)] = size
        return size

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """``node``'s pairs with its merge keys resolved (each node once: an anchor merged twice is flattened
        already), ordered so that the constructor, where a later pair wins, gives the spec's result: the merged
        mappings last to first, then the mapping's own pairs."""
        if id(node) in self._flattened:
            return
        self._flattened.add(id(node))
        self._refuse_repeated_keys(node)
        merged, own = [], []
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                own.append((key_node, value_node))
                continue
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"expected a mapping or list of mappings for merging, but found {source.id}",
                        source.start_mark,
                    )
                self.flatten_mapping(source)
                merged.append(source.value)
        node.value = [pair for pairs in reversed(merged) for pair in pairs] + own

    def _refuse_repeated_keys(self, node: yaml.MappingNode) -> None:
        seen = set()
        for key_node, _ in node.value:
            # A merge key has no constructor of its own: flatten_mapping reads it.
            key = _MERGE_KEY if key_node.tag == _MERGE_TAG else self.construct_object(key_node)
            if not isinstance(key, Hashable):  # SafeConstructor refuses it in its own words
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)


_MERGE_TAG = "tag:yaml.org,2002:merge"


MAX_VALUES = 1_000_000
"""The most values (mappings, lists, scalars) a config file may hold with its aliases written out; a real config
holds a few hundred."""


class TooLargeYAML(yaml.YAMLError):
    """A YAML document whose aliases of aliases write out to more than `MAX_VALUES` values."""

    def __init__(self, key: str, mark) -> None:
        super().__init__(
            f"{key} (line {mark.line + 1}, column {mark.column + 1}) holds more than {MAX_VALUES:,} values with its "
            "aliases written out (aliases of aliases), which no config does"
        )


class RecursiveYAML(yaml.YAMLError):
    """A YAML document whose data would hold itself: an anchor's alias inside the anchored node."""

    def __init__(self, key: str, anchor: str | None, mark) -> None:
        self.key, self.anchor, self.mark = key, anchor, mark
        name = f"&{self.anchor}" if self.anchor else "the node"
        super().__init__(
            f"{self.key} is an alias of {name} (line {self.mark.line + 1}, column {self.mark.column + 1}), which "
            "holds it: a config cannot hold itself (write the values out)"
        )


class _MergeKey:
    def __repr__(self) -> str:
        return "'<<' (a merge key)"


_MERGE_KEY = _MergeKey()


def _describe_yaml_error(error: yaml.YAMLError | RecursionError) -> str:
    """One line (PyYAML's messages take four, and name no file: the text was read first)."""
    if isinstance(error, RecursionError):  # PyYAML's composer and constructor recurse once per level
        return "nested too deeply (thousands of levels of [ or {)"
    if isinstance(error, (RecursiveYAML, TooLargeYAML)):
        return str(error)
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        problem = error.problem or error.context or "malformed"
        if error.context and error.problem:
            problem += f" ({error.context})"
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem
    if isinstance(error, yaml.reader.ReaderError):
        code = error.character if isinstance(error.character, int) else ord(error.character)
        return f"the character U+{code:04X} at offset {error.position} is not allowed in YAML (a binary file?)"
    return str(error).splitlines()[0]


def _read_yaml(path: Path, shown: str, including: tuple[Path, ...]) -> Any:
    """The YAML document in ``path``; ValueError naming it when it is absent, not a UTF-8 text file or not YAML."""
    parent = f" (included from {os.path.normpath(including[-1])})" if including else ""
    if path.is_dir():
        raise ValueError(f"{shown}: a folder, not a config file{parent}")
    if not path.is_file():
        problem = "not a regular file (a device, a pipe, ...)" if path.exists() else "no such config file"
        raise ValueError(f"{shown}: {problem}{parent}")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as error:
        raise ValueError(f"{shown}: cannot read the config file{parent}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{shown}: not a text config file{parent}: byte 0x{error.object[error.start]:02x} at offset "
            f"{error.start} is not UTF-8 (config files are UTF-8 YAML)"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except (RecursiveYAML, TooLargeYAML) as error:
        raise ValueError(f"{shown}: {_describe_yaml_error(error)}{parent}") from None
    except (yaml.YAMLError, RecursionError) as error:
        raise ValueError(f"{shown}: not valid YAML{parent}: {_describe_yaml_error(error)}") from None


def _read_config_file(
    path: Path, including: tuple[Path, ...], sections: Collection[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """A file's data merged over its includes, and where each key path was set."""
    shown = os.path.normpath(path)
    resolved = path.resolve()
    if resolved in including:
        chain = " -> ".join([os.path.normpath(p) for p in including] + [shown])
        raise ValueError(f"include cycle: {chain}")
    data = _read_yaml(path, shown, including)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{shown}: the top level must be a mapping of sections, got {type(data).__name__}")
    includes = data.pop("include", None)
    if includes is None:  # ``include:`` with its entries commented out
        includes = []
    elif isinstance(includes, str):
        includes = [includes]
    # An empty path would name the including file's own folder, and be read as "a folder, not a config file"
    if not isinstance(includes, list) or not all(isinstance(item, str) and item for item in includes):
        raise ValueError(
            f"{shown}: include={includes!r} is not allowed: a path or a list of paths (relative to {shown})"
        )
    data = _sections_of(data, sections, f"in {shown}")
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in includes:
        included, included_sources = _read_config_file(path.parent / item, including + (resolved,), sections)
        merge_mappings(merged, included)
        sources.update(included_sources)
    merge_mappings(merged, data)
    sources.update({key: f"in {shown}" for key in key_paths(data)})
    return merged, sources


def _sections_of(data: dict[str, Any], sections: Collection[str], source: str) -> dict[str, Any]:
    """One layer's data without its empty (null) sections; ConfigError naming the key and ``source`` for a value of
    one of ``sections`` that is not a mapping (it would replace the section that earlier layers built)."""
    for name, value in data.items():
        if name in sections and value is not None and not isinstance(value, dict):
            allowed = f"a mapping of {name} keys (e.g. {name}: {{key: value}}), or nothing"
            raise ConfigError(str(name), value, allowed, source)
    return {name: value for name, value in data.items() if not (name in sections and value is None)}


def _parse_override(text: str) -> dict[str, Any]:
    """``section.key=value`` (value read as YAML) as nested data; a whole section may be given as a mapping."""
    key, sep, raw_value = text.partition("=")
    parts = key.split(".")
    if not sep or not all(parts) or len(parts) > 2:
        raise ValueError(f"override {text!r} is not section.key=value (e.g. train.max_steps=100)")
    try:
        value = yaml.load(raw_value, Loader=_UniqueKeyLoader)
    except (RecursiveYAML, TooLargeYAML) as error:
        raise ValueError(f"override {text!r}: in the value, {error}") from None
    except (yaml.YAMLError, RecursionError) as error:
        raise ValueError(f"override {text!r}: the value is not valid YAML: {_describe_yaml_error(error)}") from None
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
