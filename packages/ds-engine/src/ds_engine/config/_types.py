"""Field types shared by the config sections: integers that refuse bools, dtype names."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from pydantic import BeforeValidator, Field

from ds_engine.config._dtype_names import DTYPES, to_torch_dtype

__all__ = [
    "DTYPES",
    "DtypeName",
    "Float",
    "Int",
    "NonNegFloat",
    "NonNegInt",
    "PosFloat",
    "PosInt",
    "StepInterval",
    "dtype_name",
    "to_torch_dtype",
]


def _int_like(value: Any) -> Any:
    # pydantic's lax mode turns True into 1; a batch size of `true` is a typo, not a number.
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got the boolean {value}")
    return value


def _finite_number(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {value}")
    if isinstance(value, (int, float)) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    return value


Int = Annotated[int, BeforeValidator(_int_like)]
"""An integer; integral floats such as `5e8` are accepted (DeepSpeed configs use them), bools are not."""
PosInt = Annotated[Int, Field(gt=0)]
NonNegInt = Annotated[Int, Field(ge=0)]
Float = Annotated[float, BeforeValidator(_finite_number)]
PosFloat = Annotated[Float, Field(gt=0)]
NonNegFloat = Annotated[Float, Field(ge=0)]


def _infinite_is_never(value: Any) -> Any:
    # Accelerate writes `steps_per_print: float("inf")` to silence DeepSpeed, where `step % inf` is never 0.
    if isinstance(value, float) and value == math.inf:
        return None
    return value


StepInterval = Annotated[PosInt | None, BeforeValidator(_infinite_is_never)]
"""Every N optimizer steps; None or `inf` (as Accelerate writes it): never."""

_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def dtype_name(value: Any) -> Any:
    """`"bfloat16"`, `"BF16"`, `"torch.bfloat16"` -> `"bf16"`; anything unknown is left for the Literal to refuse."""
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.strip().lower(), value)
    if isinstance(value, torch.dtype):
        return _DTYPE_ALIASES.get(str(value), value)
    return value


DtypeName = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(dtype_name)]
"""A training dtype by name: fp32 | fp16 | bf16 (float32/float16/half/bfloat16 are accepted too)."""
