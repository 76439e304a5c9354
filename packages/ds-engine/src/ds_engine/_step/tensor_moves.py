"""`move_to_device` / `copy_to_device`: tensors inside nested lists, tuples and dicts sent to a device.

DeepSpeed's `deepspeed.runtime.utils` helpers, which Accelerate's and users' scripts call on batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["copy_to_device", "move_to_device"]


def _map(item: Any, leaf: Callable[[Any], Any]) -> Any:
    if isinstance(item, list):
        return [_map(v, leaf) for v in item]
    if isinstance(item, tuple):
        return tuple(_map(v, leaf) for v in item)
    if isinstance(item, dict):
        return {k: _map(v, leaf) for k, v in item.items()}
    return leaf(item)


def move_to_device(
    item: Any, device: torch.device | str | int, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """`item` with every tensor on `device` (lists, tuples and dicts rebuilt; other objects as they are).

    A tensor `criterion_func` accepts is moved in place (its `.data` swapped, so other references to it
    see the move) and returned itself; any other tensor is returned as `tensor.to(device)`.
    """

    def leaf(x: Any) -> Any:
        if criterion_func is not None and criterion_func(x):
            x.data = x.data.to(device)
            return x
        return x.to(device) if isinstance(x, torch.Tensor) else x

    return _map(item, leaf)


def copy_to_device(item: Any, device: torch.device | str | int, criterion_func: Callable[[Any], bool]) -> Any:
    """`item` with a copy on `device` of each object `criterion_func` accepts (usually `torch.is_tensor`);
    everything else as it is."""
    return _map(item, lambda x: x.to(device) if criterion_func(x) else x)
