"""`deepspeed.runtime.data_pipeline.data_routing`: random layerwise token dropping (random-LTD).

`basic_layer.RandomLayerTokenDrop`, `scheduler.RandomLTDScheduler`, `helper` (`convert_to_random_ltd`,
`save_without_random_ltd`, `remove_random_ltd_state_dict`) and `utils` re-export ds's `_data`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_LAZY = ("basic_layer", "helper", "scheduler", "utils")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
