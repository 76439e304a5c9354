"""`MicroStepGradients`: ZenFlow's gradient path at ZeRO stage 1 and 2.

ZenFlow needs every micro step's averaged gradient twice: whole, to pick and update the important
columns on the device at once, and as this rank's partition, accumulated on the host for the CPU
optimizer's later update. So each parameter's `.grad` is a view of a flat buffer per param group (as at
stage 1); after each backward the buffer is averaged over the data-parallel group with one all-reduce,
read by the ZenFlow loop, added into this rank's host partition accumulator, and cleared. The
accumulators are cleared only after the CPU update (`clear_accumulators`), never by `zero_grad()`.

It stands in for the ZeRO optimizer's reducer (`finish`, `zero`, `accumulators`, ...), so the rest of
the stage-1/2 optimizer (norms, checkpoints, memory accounting) reads it the same way.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._stage12.flat_buffer import FlatParamGroup

logger = logging.getLogger(__name__)

__all__ = ["MicroStepGradients"]


class MicroStepGradients:
    """Flat per-group gradient buffers averaged each micro step, and the host accumulators (module note).

    Args:
        flats: the flat parameter groups.
        accumulators: per group, this rank's fp32 host gradient partition.
        group: the data-parallel group the gradients are averaged over.
        average: divide by the group's size (False: keep the sum).
        communication_dtype: dtype of the all-reduce (None: the model dtype).
    """

    #: Every backward is reduced at once; nothing is deferred.
    deferred = False
    in_place = False

    def __init__(
        self,
        flats: list[FlatParamGroup],
        accumulators: list[torch.Tensor],
        *,
        group: ProcessGroup | None,
        average: bool,
        communication_dtype: torch.dtype | None,
    ) -> None:
        self.flats = flats
        self.accumulators = accumulators
        self.group = group
        self.world = ds_comm.get_world_size(group)
        self.average = average
        self.communication_dtype = communication_dtype
        self.flat_grads = [torch.zeros(f.padded_numel, dtype=f.dtype, device=f.device) for f in flats]
        self._dirty = False
        self.attach()

    @property
    def reduced(self) -> bool:
        return False

    @property
    def has_gradients(self) -> bool:
        return self._dirty

    def attach(self) -> None:
        """Point every parameter's `.grad` at its view of the flat gradient buffer."""
        for flat, grads in zip(self.flats, self.flat_grads, strict=True):
            for p, slot in zip(flat.params, flat.slots, strict=True):
                p.grad = flat.slot_view(grads, slot)

    def average_micro_step(self) -> list[torch.Tensor]:
        """Average this micro step's gradients over the group (a collective); returns the flat buffers.

        A `.grad` that is not the buffer's view (set to None or replaced by the caller) is copied in first.
        """
        self._dirty = True
        out = []
        for flat, grads in zip(self.flats, self.flat_grads, strict=True):
            for p, slot in zip(flat.params, flat.slots, strict=True):
                view = flat.slot_view(grads, slot)
                g = p.grad
                if g is None:
                    view.zero_()
                elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
                    view.copy_(g)
            buffer = grads
            if self.communication_dtype is not None and self.communication_dtype != grads.dtype:
                buffer = grads.to(self.communication_dtype)
            if self.world > 1:
                if self.average:
                    buffer.div_(self.world)
                ds_comm.all_reduce(buffer, group=self.group)
            if buffer is not grads:
                grads.copy_(buffer)
            out.append(grads)
        return out

    def accumulate(self) -> None:
        """Add this rank's partition of the averaged buffers into the host accumulators."""
        for flat, grads, acc in zip(self.flats, self.flat_grads, self.accumulators, strict=True):
            acc.add_(flat.own_slice(grads).to(device=acc.device, dtype=acc.dtype))

    def clear_accumulators(self) -> None:
        for acc in self.accumulators:
            acc.zero_()

    # -- the reducer surface the ZeRO optimizer reads ------------------------------------------------
    def finish(self) -> None:
        """Nothing is pending: each backward was averaged and accumulated when it ended."""

    def reduce_deferred(self) -> None:
        """Nothing is deferred (see `finish`)."""

    def zero(self) -> None:
        """Clear the micro step's gradient buffers (not the accumulators) and re-attach the `.grad` views."""
        for grads in self.flat_grads:  # always: a backward may have run outside `average_micro_step`
            grads.zero_()
        self._dirty = False
        self.attach()

    def gradient_tensors(self) -> list[torch.Tensor]:
        return list(self.flat_grads)

    def close(self) -> None:
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
