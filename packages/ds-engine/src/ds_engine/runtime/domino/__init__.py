"""`deepspeed.runtime.domino`: Domino, tensor parallelism whose all-reduces overlap compute (ds-parallel's
`ds_parallel.domino`): `transformer` (the layers and schedules) and `async_linear` (the linears).

Needs the `parallel` extra.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["async_linear", "transformer"]


def __getattr__(name: str) -> ModuleType:
    # Submodules load on first use: they reach ds-parallel (an optional extra).
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
