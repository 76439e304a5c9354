"""Precision names of the ds_config (`"fp32"`, `"fp16"`, `"bf16"`) and their torch dtypes, without pydantic."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "to_torch_dtype"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def to_torch_dtype(name: str) -> torch.dtype:
    """`"bf16"` -> `torch.bfloat16`."""
    return DTYPES[name]
