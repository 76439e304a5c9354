"""`deepspeed.runtime.activation_checkpointing`: holds `checkpointing` (ds-pipe's, the `pipe` extra)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type checkers see the lazy submodule
    from ds_engine.runtime.activation_checkpointing import checkpointing as checkpointing

__all__: list[str] = []


def __getattr__(name: str) -> ModuleType:
    if name == "checkpointing":
        return importlib.import_module("ds_engine.runtime.activation_checkpointing.checkpointing")
    raise AttributeError(f"module 'ds_engine.runtime.activation_checkpointing' has no attribute {name!r}")
