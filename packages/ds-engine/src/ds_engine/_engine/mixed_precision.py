"""DeepSpeedEngine's mixed-precision hooks under DeepSpeed's private names, as its tests and subclasses call them.

initialize() casts the model once (`_engine/assembly.py`, through `_step/mixed_precision.py`); these methods answer
the same questions for code that calls DeepSpeed's engine methods directly, from `self._config` and the
fp16/bf16 getters only (DeepSpeed's tests call them on stand-ins that have nothing else).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_engine._step.mixed_precision import cast_module_mixed_precision, mixed_precision_dtypes

if TYPE_CHECKING:
    from re import Pattern

__all__ = ["EngineMixedPrecision"]


class EngineMixedPrecision:
    """Mixed into `DeepSpeedEngine`."""

    _config: Any
    module: nn.Module

    if TYPE_CHECKING:

        def fp16_enabled(self) -> bool: ...

        def bfloat16_enabled(self) -> bool: ...

    def _assert_valid_mixed_precision_config(self) -> None:
        """Refuse a `data_types.param_dtype` other than the dtype the fp16/bf16 switches train in.

        Raises:
            ParamDtypeConflictError: they disagree (an `AssertionError`, as DeepSpeed raises, and a `ValueError`).
        """
        # Here, not at module level: the config checks import pydantic, which `import ds_engine` must not load.
        from ds_engine.config._checks import check_param_dtype

        check_param_dtype(self._config.param_dtype, fp16=self.fp16_enabled(), bf16=self.bfloat16_enabled())

    def _mixed_precision_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(parameter dtype, buffer dtype) of the cast: the fp16/bf16 dtype (None under fp32) and
        `data_types.buffer_dtype` (None: buffers keep theirs)."""
        precision = "fp16" if self.fp16_enabled() else "bf16" if self.bfloat16_enabled() else "fp32"
        return mixed_precision_dtypes(precision, self._config.buffer_dtype)

    def _cast_module_mixed_precision(
        self,
        param_dtype: torch.dtype | None,
        buffer_dtype: torch.dtype | None,
        is_zero_init_model: bool,
        keep_pattern: Pattern[str] | None = None,
    ) -> None:
        """Cast `self.module`'s parameters (unless built under `zero.Init`) and, when asked, its buffers; buffers
        whose names `keep_pattern` matches stay (or become) fp32 (`data_types.keep_in_fp32_modules`)."""
        cast_module_mixed_precision(
            self.module, param_dtype, buffer_dtype, skip_params=is_zero_init_model, keep_fp32=keep_pattern
        )
