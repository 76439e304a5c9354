"""`deepspeed.runtime.zero.leaf_module_config`: the `zero_optimization.leaf_module` model and its defaults.

`DeepSpeedZeroLeafModuleConfig` is ds-zero's `LeafModuleConfig`; the `DEFAULT_LEAF_MODULE_*` lists are
what its fields hold when not given (lists, as the model's fields are, so they compare equal to them).
Needs the `zero` extra: without ds-zero, using a name here raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # served by __getattr__ from ds-zero
    from ds_zero.config import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

    DEFAULT_LEAF_MODULE_CLASSES: list[str]
    DEFAULT_LEAF_MODULE_NAMES: list[str]
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str]

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ds_engine._optional import require

        require("ds_zero", extra="zero", feature=f"deepspeed.runtime.zero.leaf_module_config.{name}")
        config = importlib.import_module("ds_zero.config")
        if name == "DeepSpeedZeroLeafModuleConfig":
            return config.LeafModuleConfig
        defaults = config.LeafModuleConfig()  # a fresh list per access: callers may extend theirs
        field = {
            "DEFAULT_LEAF_MODULE_CLASSES": "classes",
            "DEFAULT_LEAF_MODULE_NAMES": "names",
            "DEFAULT_LEAF_MODULE_NAME_SUFFIXES": "name_suffixes",
        }[name]
        return list(getattr(defaults, field))
    raise AttributeError(f"module 'ds_engine.runtime.zero.leaf_module_config' has no attribute {name!r}")
