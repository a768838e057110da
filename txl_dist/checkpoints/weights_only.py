"""Reading DeepSpeed's checkpoint files without running code from them.

A ``.pt`` file is a pickle, and a full unpickler runs whatever a crafted file asks for (a ``__reduce__`` that
calls ``os.system``). DeepSpeed reads its files with ``torch.load(weights_only=False)``, in its engine, in
``zero_to_fp32`` and in ``ds_to_universal``. Here every such read goes through ``torch.load(weights_only=True)``:
tensors, containers, numbers, strings, and the few DeepSpeed classes its files hold (`ALLOWED_CLASSES`,
registered with ``torch.serialization.add_safe_globals``). Anything else is refused with `UnsafeCheckpointError`
naming the file and the class, before any of it is constructed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

from txl_dist import deepspeed_internals


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would need more than the weights-only unpickler and its allow-list."""


ALLOWED_CLASSES = deepspeed_internals.CHECKPOINT_CLASSES
"""The DeepSpeed classes found in its checkpoint files (`txl_dist.deepspeed_internals.CHECKPOINT_CLASSES`). Named,
and resolved when the first file is read: importing this module imports no DeepSpeed (evaluating or converting an
export folder never needs it)."""


def allowed_classes() -> list[type]:
    """`ALLOWED_CLASSES`, the classes themselves."""
    return deepspeed_internals.checkpoint_classes()


@functools.cache
def _register() -> None:
    torch.serialization.add_safe_globals(allowed_classes())


_ORIGINAL_LOAD = torch.load
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with DeepSpeed's classes allowed; anything else raises
    `UnsafeCheckpointError` naming the file and the class."""
    _register()
    kwargs["weights_only"] = True
    try:
        return _ORIGINAL_LOAD(f, map_location=map_location, **kwargs)
    except pickle.UnpicklingError as error:
        name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f)
        found = _GLOBAL_RE.search(str(error))
        what = f"it refers to {found.group(1)}" if found else str(error).splitlines()[0]
        raise UnsafeCheckpointError(
            f"{name}: refused to unpickle: {what}, which is neither a tensor nor one of the DeepSpeed classes a "
            f"checkpoint holds (txl_dist.checkpoints.weights_only.ALLOWED_CLASSES); loading it could run code. A "
            f"file written by txl_dist never needs it: treat this checkpoint as tampered with"
        ) from None


_patch_lock = threading.Lock()
_patch_depth = 0


@contextlib.contextmanager
def deepspeed_loads_weights_only() -> Iterator[None]:
    """Within the block, every ``torch.load`` -- DeepSpeed's engine, ``zero_to_fp32``, ``ds_to_universal`` all
    call it with ``weights_only=False`` -- is `load`. ``torch.load`` is swapped, not DeepSpeed's modules,
    because they call it in a dozen places; the swap is undone on exit, also on an error."""
    global _patch_depth
    with _patch_lock:
        _patch_depth += 1
        torch.load = _load_any_signature
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch.load = _ORIGINAL_LOAD


def _load_any_signature(
    f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None, **kwargs: Any
) -> Any:
    # pickle_module and weights_only are what callers pass to ask for a full unpickler: both are overruled.
    return load(f, map_location=map_location, **kwargs)
