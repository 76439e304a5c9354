"""`deepspeed.runtime.data_pipeline`: DeepSpeed's data efficiency library under its module paths.

`constants`, `config` (the section's readers), `curriculum_scheduler` (`CurriculumScheduler`) and
`data_routing` (random-LTD: `basic_layer`, `scheduler`, `helper`, `utils`) re-export ds's
`ds_engine._data`; `data_sampling` is ds-engine's `_data`. Submodules load on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_LAZY = ("config", "constants", "curriculum_scheduler", "data_routing", "data_sampling")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
