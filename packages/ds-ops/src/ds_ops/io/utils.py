"""`deepspeed.io.utils`: byte/tensor conversions the writers use (`ds_ops.fast_io.serial`)."""

from __future__ import annotations

from ds_ops.fast_io.serial import (
    bytes_to_tensor,
    obj_serialization_details,
    required_minimum_torch_version,
    serialize_details,
    tensor_to_bytes,
)

__all__ = [
    "bytes_to_tensor",
    "obj_serialization_details",
    "required_minimum_torch_version",
    "serialize_details",
    "tensor_to_bytes",
]
