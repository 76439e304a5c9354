"""`deepspeed.runtime.data_pipeline.data_sampling`: the mmap indexed dataset, the data analyzer, the curriculum
data sampler and dynamic batching (ds-engine's `_data`)."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["data_analyzer", "data_sampler", "indexed_dataset", "utils", "variable_batch_size_and_lr"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
