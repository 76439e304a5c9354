"""The stage-3 optimizer's per-parameter bookkeeping: where each trained parameter's master and gradient live.

The optimizer owns one `PartitionIndex`; it holds a `ParamSlots` record for every parameter it trains
(keyed by the parameter's `id`, as the optimizer keeps the parameters alive). The record says where the
fp32 master slice is (or how to write it when it is swapped to NVMe), which reduce bucket the gradient
goes to, and where in the flat fp32 gradient partition the reduced shard accumulates. Keeping this with
the optimizer leaves `ZeroParamState` with the parameter's own state; the parameter only learns that an
optimizer indexed it (`ZeroParamState.master_sink`), through which writes of its shard also reach the
master and which refuses `.to()`/`.half()` from then on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
from torch import nn

from ds_zero._params.partitioned_param import state_of

logger = logging.getLogger(__name__)

__all__ = ["ParamSlots", "PartitionIndex"]


@dataclasses.dataclass(slots=True, eq=False)
class ParamSlots:
    """Where the stage-3 optimizer keeps one trained parameter's master and gradient on this rank."""

    grad_flat: torch.Tensor
    """The group's flat fp32 master (a NaN placeholder while swapped to NVMe), whose `.grad` is the flat fp32
    gradient partition the reduced shard is accumulated into."""
    grad_offset: int
    """Offset of this parameter's shard in `grad_flat`."""
    master: torch.Tensor | None = None
    """The fp32 master slice of this shard (None while the master is swapped to NVMe)."""
    master_writer: Callable[[torch.Tensor], None] | None = None
    """Writes a new (padded) fp32 master slice when the master is swapped to NVMe (optimizer offload)."""
    grad_bucket: int | None = None
    """Index of the gradient reduce bucket the parameter's gradient goes to (set by the `GradReducer`)."""


class PartitionIndex:
    """`ParamSlots` of every parameter one stage-3 optimizer trains, keyed by `id(param)`."""

    def __init__(self) -> None:
        self._slots: dict[int, ParamSlots] = {}

    def add(
        self, param: nn.Parameter, *, grad_flat: torch.Tensor, grad_offset: int, master: torch.Tensor | None
    ) -> ParamSlots:
        """Index `param` and tell its state that this optimizer now holds its master."""
        slots = ParamSlots(grad_flat=grad_flat, grad_offset=grad_offset, master=master)
        self._slots[id(param)] = slots
        state_of(param).master_sink = self
        return slots

    def __getitem__(self, param: nn.Parameter) -> ParamSlots:
        return self._slots[id(param)]

    def __contains__(self, param: object) -> bool:
        return id(param) in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def write_master(self, param: nn.Parameter, piece: torch.Tensor) -> None:
        """Write this rank's (unpadded) slice `piece` of `param`'s values into its fp32 master, zero-padded.

        Called by `ZeroParamState.write_shard_from_full` after the shard itself was written.
        """
        slots = self._slots.get(id(param))
        if slots is None:
            return
        s, n = state_of(param).shard_numel, piece.numel()
        with torch.no_grad():
            if slots.master_writer is not None:
                padded32 = torch.zeros(s, dtype=torch.float32)
                padded32[:n].copy_(piece)
                slots.master_writer(padded32)
            elif slots.master is not None and slots.master is not param.ds_tensor:
                slots.master[:n].copy_(piece)
                slots.master[n:].zero_()
