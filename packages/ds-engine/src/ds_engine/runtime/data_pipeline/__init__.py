"""`deepspeed.runtime.data_pipeline`: DeepSpeed's data efficiency library; `data_sampling` is ds-engine's `_data`."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["data_sampling"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
