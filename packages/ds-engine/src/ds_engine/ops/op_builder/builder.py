"""`deepspeed.ops.op_builder.builder`: the op builder base classes, ds-ops' own (`OpBuilder`, `CUDAOpBuilder`)."""

from __future__ import annotations

from ds_ops.op_builder import CUDAOpBuilder, OpBuilder

__all__ = ["CUDAOpBuilder", "OpBuilder"]
