"""Checks and lookups shared by the stage 1/2 and stage 3 per-parameter accessors."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_numel", "state_tensor"]


def check_numel(value: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    """`value` flattened, after checking it has `numel` elements.

    Raises:
        TypeError: `value` is not a tensor.
        ValueError: the element counts differ (names `what`).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: the value must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != numel:
        raise ValueError(f"{what}: the value has {value.numel()} elements, expected {numel}")
    return value.reshape(-1)


def state_tensor(optimizer: torch.optim.Optimizer, master: torch.Tensor, key: str, what: str) -> torch.Tensor:
    """The base optimizer's state `key` of its parameter `master` (a tensor of `master`'s shape).

    Raises:
        ValueError: no such state (before the first step, or a key this optimizer does not keep); the
            message lists the keys that exist.
    """
    state: dict[str, Any] = optimizer.state.get(master, {})
    value = state.get(key)
    if not isinstance(value, torch.Tensor) or value.shape != master.shape:
        keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == master.shape)
        raise ValueError(
            f"{what}: optimizer state {key!r} not found; the optimizer keeps {keys or 'no per-element state yet'}"
            " (state exists after the first step)"
        )
    return value
