"""Package names imported on first use (PEP 562), for the packages whose ``__init__`` must stay light.

A package lists where each public name lives; ``from package import name`` then imports that one module, and
``import package`` imports none of them::

    __getattr__, __dir__ = lazy_names(__name__, {"plan_memory": "txl_dist.plan.memory"})

`tests/test_architecture.py` reads the table as the package's imports, so the layers hold for it too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``, whose names ``homes`` maps to the module
    that defines each. A name is imported once and kept in the package's namespace."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
