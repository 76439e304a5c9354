"""`deepspeed.runtime.zero` for migrated scripts: ds-zero's API (`Init`, `GatheredParameters`...) under that path.

Everything ds-zero exports, looked up on ds-zero itself (the same objects as `ds_engine.zero`);
`runtime.zero.partition_parameters` is DeepSpeed's module of the stage-3 construction API, and this
package's other modules (`config`, `offload_config`, `stage3`...) are DeepSpeed's paths too. Needs the
`zero` extra: without ds-zero, importing this package raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ds_engine._reexport import optional_reexport

__all__, _zero_getattr, __dir__ = optional_reexport(
    "ds_engine.runtime.zero", "ds_zero", extra="zero", feature="ds_engine.runtime.zero (deepspeed.runtime.zero, ZeRO)"
)

#: This package's own modules (DeepSpeed's paths: `config`, `offload_config`, `stage3`...). They win over
#: ds-zero's attributes of the same name: `from deepspeed.runtime.zero import config` is DeepSpeed's module
#: (`DeepSpeedZeroConfig`, `ZeroStageEnum`), not ds-zero's `ds_zero.config`.
_SUBMODULES = frozenset(info.name for info in pkgutil.iter_modules(__path__))


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _zero_getattr(name)
