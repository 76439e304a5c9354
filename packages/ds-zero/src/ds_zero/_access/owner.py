"""Which ZeRO optimizer holds a parameter's fp32 master, gradient and optimizer state.

A ZeRO optimizer registers its trainable parameters when it is built; a later optimizer over the same
parameters takes them over. The registry holds the parameters and optimizers weakly, so it keeps
neither alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["register_owner", "zero_optimizer_of"]

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
