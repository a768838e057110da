"""Explicit state-dict key maps: a table of patterns such as ``("layers.{n}.{rest}", "transformer.layers.{n}.{rest}")``.

A pattern is literal text with ``{name}`` fields; the same fields appear on both sides. Every key must match
exactly one rule's source side, so a layout change shows up as an error instead of a silently dropped weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TypeVar

V = TypeVar("V")


def _compile(pattern: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", pattern)
    regex = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>.+?)" for i, part in enumerate(parts))
    return re.compile(regex)


class KeyMap:
    def __init__(self, rules: Iterable[tuple[str, str]], source_name: str, target_name: str):
        self.rules = list(rules)
        self.source_name, self.target_name = source_name, target_name
        self._forward = [(_compile(src), dst) for src, dst in self.rules]
        self._backward = [(_compile(dst), src) for src, dst in self.rules]

    @staticmethod
    def _apply(key: str, compiled: list[tuple[re.Pattern, str]], direction: str) -> str:
        matches = [(regex, template) for regex, template in compiled if regex.fullmatch(key)]
        if len(matches) != 1:
            problem = "no rule" if not matches else f"{len(matches)} rules"
            raise KeyError(f"{direction}: {problem} for the key {key!r}")
        regex, template = matches[0]
        return template.format(**regex.fullmatch(key).groupdict())

    def forward(self, state: Mapping[str, V]) -> dict[str, V]:
        direction = f"{self.source_name} -> {self.target_name}"
        return {self._apply(k, self._forward, direction): v for k, v in state.items()}

    def backward(self, state: Mapping[str, V]) -> dict[str, V]:
        direction = f"{self.target_name} -> {self.source_name}"
        return {self._apply(k, self._backward, direction): v for k, v in state.items()}
