"""`deepspeed.runtime.activation_checkpointing`: `checkpointing` (ds-pipe's, `pipe` extra), `offload_activations`."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type checkers see the lazy submodules
    from ds_engine.runtime.activation_checkpointing import checkpointing as checkpointing
    from ds_engine.runtime.activation_checkpointing import offload_activations as offload_activations

__all__: list[str] = []

_SUBMODULES = ("checkpointing", "offload_activations")


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"ds_engine.runtime.activation_checkpointing.{name}")
    raise AttributeError(f"module 'ds_engine.runtime.activation_checkpointing' has no attribute {name!r}")
