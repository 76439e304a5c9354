"""`deepspeed.utils` for migrated scripts: `logger`, `log_dist`, ZeRO's accessors and leaf modules, submodules.

`RepeatingLoader` is `runtime.dataloader`'s (`_data.repeating_loader`); `utils.numa` has `parse_range_list`
(`--bind_core_list` syntax).
Submodules at DeepSpeed's paths: `nvtx` (`instrument_w_nvtx`), `pin_memory_tracker` and `comms_logging`
(ds-comm's pinned-memory total and comms logger), `timer` (`trim_mean`), `torch` (`required_torch_version`),
`bwc` (an mpu's tensor- and pipeline-parallel degrees, whichever API generation it has),
`module_utils` (`recursive_getattr`/`recursive_setattr`: a model's attributes by dotted name, also
exported here).

`logger` is DeepSpeed's "DeepSpeed" logger, the parent of every ds package's logger (`utils.logging`'s
note; the library adds no handlers); `log_dist(message, ranks=(0,), level=logging.INFO)` logs on the
listed ranks only (ds-comm's); `set_log_level_from_string("info")` sets that logger's and every ds
package's level (what the config's `log_level` does at initialize()). The ZeRO accessors
(`safe_get_full_fp32_param`, `safe_get_full_grad`...) are `utils.tensor_fragment`'s, which needs no sibling
to import. The ZeRO-3 leaf-module functions (`set_z3_leaf_modules`...; `utils.z3_leaf_module`, which
needs the `zero` extra), `utils.zero_to_fp32` (the `zero` extra) and `utils.groups` (ds-parallel's mesh
views, the `parallel` extra) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ds_engine._data.repeating_loader import RepeatingLoader
from ds_engine._step import tensor_fragment
from ds_engine._step.tensor_fragment import *  # noqa: F403 - the 13 accessors, listed in its __all__
from ds_engine.utils.init_on_device import OnDevice

# Binds `ds_engine.utils.logging` to the submodule (DeepSpeed's `deepspeed.utils.logging`), not the stdlib's.
from ds_engine.utils.logging import log_dist, logger, set_log_level_from_string
from ds_engine.utils.module_utils import recursive_getattr, recursive_setattr

if TYPE_CHECKING:  # type checkers see the lazy submodules and names
    from ds_engine.utils import groups as groups
    from ds_engine.utils import z3_leaf_module as z3_leaf_module
    from ds_engine.utils import zero_to_fp32 as zero_to_fp32
    from ds_engine.utils.z3_leaf_module import (  # noqa: F401
        get_z3_leaf_modules,
        set_z3_leaf_module,
        set_z3_leaf_modules,
        set_z3_leaf_modules_by_name,
        set_z3_leaf_modules_by_suffix,
        unset_z3_leaf_modules,
        z3_leaf_parameter,
    )

_SUBMODULES = (
    "comms_logging",
    "groups",
    "numa",
    "nvtx",
    "pin_memory_tracker",
    "timer",
    "torch",
    "z3_leaf_module",
    "zero_to_fp32",
)

#: name -> the submodule that serves it (imported on first use: these need optional siblings).
_LAZY_NAMES = {
    name: "z3_leaf_module"
    for name in (
        "get_z3_leaf_modules",
        "set_z3_leaf_module",
        "set_z3_leaf_modules",
        "set_z3_leaf_modules_by_name",
        "set_z3_leaf_modules_by_suffix",
        "unset_z3_leaf_modules",
        "z3_leaf_parameter",
    )
}

__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "log_dist",
    "logger",
    "recursive_getattr",
    "recursive_setattr",
    "set_log_level_from_string",
    *tensor_fragment.__all__,
    *sorted(_LAZY_NAMES),
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"ds_engine.utils.{name}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"ds_engine.utils.{_LAZY_NAMES[name]}"), name)
    raise AttributeError(f"module 'ds_engine.utils' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES, *_LAZY_NAMES})
