"""What the stage 1/2 and stage 3 per-parameter accessors share: the owner registry and the value checks.

DeepSpeed's `safe_get_full_fp32_param` family reads and writes one parameter's fp32 master, gradient and
optimizer state. `zero_optimizer_of` finds the ZeRO optimizer holding them: a ZeRO optimizer registers its
trainable parameters when it is built (`register_owner`); a later optimizer over the same parameters takes
them over. The registry holds the parameters and optimizers weakly, so it keeps neither alive. The
optimizers' methods for one parameter live with each stage (`_stage12.param_access`,
`_stage3.param_access`), whole (a collective over the data-parallel group) or this rank's partition.

[Note: a new fp32 master reaches the model's weights at once]
DeepSpeed's setters write only the fp32 master; the model's 16-bit weights take it at the next step.
In ds an fp32 model's master *is* the model's own partition (no second copy, `_stage12.partitions`), so
a master-only write would change one rank's part of a stage-1/2 weight and not the others', and the
ranks would compute with different weights until the step. So setting a master value also writes the
model's weights (the whole value at stages 1/2, which every rank passes; the shard at stage 3), the same
on every rank and for every dtype. After the next step both behaviours agree; in between, ds computes
with the new value. Optimizer-state setters touch only the state.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["check_numel", "register_owner", "state_tensor", "zero_optimizer_of"]

# keyed by identity: a tensor's `==` is elementwise, which a plain WeakKeyDictionary would call
_owners = WeakIdKeyDictionary()


def register_owner(params: Iterable[torch.Tensor], optimizer: Any) -> None:
    """Record `optimizer` as the holder of the partitioned state of every parameter in `params`."""
    ref = weakref.ref(optimizer)
    for p in params:
        _owners[p] = ref


def zero_optimizer_of(param: torch.Tensor) -> Any:
    """The live ZeRO optimizer (stage 1, 2 or 3) that trains `param`, or None (frozen, not in one, stage 0)."""
    ref = _owners.get(param)
    return None if ref is None else ref()


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
