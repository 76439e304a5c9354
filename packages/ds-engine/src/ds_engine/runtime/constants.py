"""`deepspeed.runtime.constants`: the ds_config key names and defaults that DeepSpeed's users and tests import.

Each `*_DEFAULT` is read from the config model's field, so the model stays the one place a default is written.
"""

from __future__ import annotations

from ds_engine.config._key_values import key_default

__all__ = [
    "BUFFER_DTYPE",
    "BUFFER_DTYPE_DEFAULT",
    "DATA_TYPES",
    "GRADIENT_CLIPPING",
    "GRADIENT_CLIPPING_DEFAULT",
    "GRAD_ACCUM_DTYPE",
    "GRAD_ACCUM_DTYPE_DEFAULT",
    "LOG_LEVEL",
    "LOG_LEVEL_DEFAULT",
    "PARAM_DTYPE",
    "PARAM_DTYPE_DEFAULT",
    "TORCH_AUTOCAST",
    "TORCH_AUTOCAST_DTYPE",
    "TORCH_AUTOCAST_ENABLED",
    "TORCH_AUTOCAST_ENABLED_DEFAULT",
    "TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES",
]

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT: float = key_default(GRADIENT_CLIPPING)

LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT: str | None = key_default(LOG_LEVEL)

DATA_TYPES = "data_types"
_DATA_TYPES = key_default(DATA_TYPES)
GRAD_ACCUM_DTYPE = "grad_accum_dtype"
GRAD_ACCUM_DTYPE_DEFAULT: str | None = _DATA_TYPES.grad_accum_dtype
PARAM_DTYPE = "param_dtype"
PARAM_DTYPE_DEFAULT: str | None = _DATA_TYPES.param_dtype
BUFFER_DTYPE = "buffer_dtype"
BUFFER_DTYPE_DEFAULT: str | None = _DATA_TYPES.buffer_dtype

TORCH_AUTOCAST = "torch_autocast"
TORCH_AUTOCAST_ENABLED = "enabled"
TORCH_AUTOCAST_ENABLED_DEFAULT: bool = key_default(TORCH_AUTOCAST).enabled
TORCH_AUTOCAST_DTYPE = "dtype"
TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES = "lower_precision_safe_modules"
