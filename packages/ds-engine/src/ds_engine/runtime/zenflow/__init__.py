"""`deepspeed.runtime.zenflow`: ZenFlow's config model (`zenflow_config`) and core split (`zenflow_utils`).

ds parses the `zero_optimization.zenflow` section (ds-zero's `ZenFlowConfig`) but runs no ZenFlow
training loop: `initialize()` refuses a config that enables it. The selective optimizers are
ds-ops' (`deepspeed.ops.adam.ZenFlowSelectiveAdamW[_stage3]`) and work on their own.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["zenflow_config", "zenflow_utils"]


def __getattr__(name: str) -> ModuleType:
    # Submodules load on first use: `zenflow_config` reaches ds-zero (an optional extra).
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
