"""`deepspeed.compression.helper`: the old home of `recursive_getattr` / `recursive_setattr` (deprecated).

Importing it works as in DeepSpeed 0.19.8: the two functions are `deepspeed.utils.module_utils`'s (the same
objects), and the import raises a `FutureWarning` that names the new path, once per process (the module is
cached after its first import, like any other).
"""

from __future__ import annotations

import warnings

from ds_engine._parallel.module_attrs import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]

warnings.warn(
    "deepspeed.compression.helper is deprecated; import recursive_getattr and recursive_setattr from "
    "deepspeed.utils.module_utils instead",
    FutureWarning,
    stacklevel=2,
)
