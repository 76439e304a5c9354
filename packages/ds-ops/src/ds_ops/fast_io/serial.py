"""Byte/tensor conversions around torch's serialization: a storage's bytes, dtype and element count."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ds_ops.fast_io._base import storage_bytes

__all__ = [
    "bytes_to_tensor",
    "obj_serialization_details",
    "required_minimum_torch_version",
    "serialize_details",
    "tensor_to_bytes",
]


@dataclasses.dataclass
class serialize_details:  # noqa: N801 - DeepSpeed's name
    """One storage as torch writes it: the storage, its dtype, its element count and its bytes."""

    obj: Any
    dtype: torch.dtype
    size: int
    nbytes: int


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes (a host tensor; contiguous order)."""
    return bytes(tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy())


def bytes_to_tensor(buffer: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor holding a copy of `buffer`."""
    return torch.frombuffer(bytearray(buffer), dtype=torch.uint8)


def required_minimum_torch_version(major_version: int, minor_version: int) -> bool:
    """Whether the running torch is at least `major_version.minor_version`."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (major_version, minor_version)


def _details(storage_obj: Any) -> serialize_details:
    data = storage_bytes(storage_obj)
    dtype = storage_obj[1] if isinstance(storage_obj, tuple) else torch.uint8
    return serialize_details(obj=storage_obj, dtype=dtype, size=data.numel() // dtype.itemsize, nbytes=data.numel())


def obj_serialization_details() -> Callable[[Any], serialize_details]:
    """The function that describes a storage `(untyped_storage, dtype)` as torch (>= 1.12) hands them over."""
    return _details
