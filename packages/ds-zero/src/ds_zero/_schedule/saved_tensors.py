"""The saved-tensor safety net: autograd never keeps a released parameter's storage, it re-gathers on unpack.

While a forward with grad runs, saved-tensor hooks replace every tensor autograd saves that views a
partitioned parameter's full storage (`weight` itself, `weight.t()` inside `F.linear`, ...) by a marker:
(parameter, size, stride, offset). On unpack (in backward) the marker becomes the same view of the full
storage again, gathered first if it has been released meanwhile. The module hooks normally gather a
module's parameters before its backward; the net covers the backward that no hook anticipated (a
parameter used outside its module, autograd functions saved across modules), so it still reads the right
values instead of a released storage's NaN placeholder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_zero._params.partitioned_param import ZeroParamStatus, state_of
from ds_zero._schedule.live import LiveParams
from ds_zero._schedule.units import UnitRegistry

logger = logging.getLogger(__name__)

__all__ = ["SavedTensorNet"]


class SavedTensorNet:
    """The pack/unpack hooks of one model, entered for the duration of each forward with grad.

    Args:
        registry: maps a full storage back to its parameter.
        live: the pool a re-gather goes through.
        hold: keeps a parameter gathered on unpack until the end of the iteration.
    """

    def __init__(self, registry: UnitRegistry, live: LiveParams, hold: Callable[[nn.Parameter], None]) -> None:
        self.registry = registry
        self.live = live
        self.hold = hold
        self._hooks: Any = None

    def enter(self) -> None:
        """Install the hooks (no-op while already installed)."""
        if self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def exit(self) -> None:
        """Remove the hooks (no-op while not installed); tensors saved so far keep their markers."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # no plain storage (sparse, ...)
            return tensor
        param = self.registry.param_for_storage(key)
        if param is None:
            return tensor
        return (param, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        param, size, stride, offset = packed
        if param.ds_status is not ZeroParamStatus.AVAILABLE:
            released = param.ds_status is ZeroParamStatus.NOT_AVAILABLE
            self.live.gather([param], f"parameter {state_of(param).name!r} needed by backward", checked=True)
            if released:
                logger.debug("stage 3: backward needed %s before any hook gathered it", state_of(param).name)
            self.hold(param)
        return state_of(param).full.as_strided(size, stride, offset)
