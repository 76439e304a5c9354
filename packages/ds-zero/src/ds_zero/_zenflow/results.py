"""Where ZenFlow's overlapped CPU update leaves its result, and how the result reaches the model.

`overlap_step` applies each window's CPU update one window late: the worker process computes it while the
model still trains on the previous result, and the training process puts it into the model at the next
window's end. Two ways, both behind `slots()` (what the worker writes into), `writes_next` (which slot the
next update writes) and `apply()`:

- `CopiedResult`: one shared "stale" tensor per master, copied into the model's partition by `apply()`.
  For a model on an accelerator (the copy is the host-to-device copy DeepSpeed makes too) and for ZeRO-3's
  tiles.
- `SwappedBuffers`: a model whose ZeRO-1/2 flat buffers are in host memory, and small enough (below), gets
  a second flat buffer per group, both in shared memory; the worker writes the result straight into the
  own partition of the buffer the model is not using, and `apply()` points the parameters at it. On a CPU
  host the copy would move as many bytes as the update the worker takes over reads (both memory-bound), so
  it would keep about a third of the update's time in the step; the swap re-points a view per parameter.
  The other ranks' partitions of the swapped-in buffer are stale until the all-gather that follows every
  `apply()` refreshes them. The twin is a whole flat buffer where the stale copy is one partition, so it is
  used only where it costs no more memory (`result_slots`): with more ranks the copy is a smaller share of
  the model and the twin a larger one, and ds keeps its memory at or below DeepSpeed's.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_zero._stage12.flat_buffer import FlatParamGroup

__all__ = ["CopiedResult", "SwappedBuffers", "result_slots"]


class CopiedResult:
    """The result in one shared fp32 tensor per master, copied into each target's `own_partition`."""

    writes_next = 0

    def __init__(self, targets: list[Any], masters: list[torch.Tensor]) -> None:
        self.targets = targets
        self.stale = [torch.zeros_like(m).share_memory_() for m in masters]

    def slots(self) -> list[list[torch.Tensor]]:
        """Per master, the tensors the worker may write its result into (slot `writes_next`)."""
        return [[s] for s in self.stale]

    def pending(self) -> list[torch.Tensor]:
        """The result the next `apply()` puts into the model."""
        return self.stale

    def apply(self) -> None:
        with torch.no_grad():
            for target, stale in zip(self.targets, self.stale, strict=True):
                target.own_partition.copy_(stale)


class SwappedBuffers:
    """Two shared flat buffers per group; the worker writes into the idle one, `apply()` swaps them."""

    def __init__(self, flats: list[FlatParamGroup]) -> None:
        self.flats = flats
        for flat in flats:
            flat.flat.share_memory_()  # in place: the parameters' views follow the storage
        self.buffers = [[flat.flat, flat.flat.clone().share_memory_()] for flat in flats]
        self.views = [[f.param_views(b) for b in pair] for f, pair in zip(flats, self.buffers, strict=True)]
        #: the buffer the model does not use: the worker writes the next result into its own partition
        self.writes_next = 1

    def slots(self) -> list[list[torch.Tensor]]:
        return [[f.own_slice(b) for b in pair] for f, pair in zip(self.flats, self.buffers, strict=True)]

    def pending(self) -> list[torch.Tensor]:
        return [f.own_slice(pair[self.writes_next]) for f, pair in zip(self.flats, self.buffers, strict=True)]

    def apply(self) -> None:
        for flat, pair, views in zip(self.flats, self.buffers, self.views, strict=True):
            flat.use_buffer(pair[self.writes_next], views[self.writes_next])
        self.writes_next = 1 - self.writes_next


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def result_slots(targets: list[Any], masters: list[torch.Tensor]) -> CopiedResult | SwappedBuffers:
    """`SwappedBuffers` where every target is a host-memory ZeRO-1/2 flat group whose twin costs no more
    memory than the stale copy it replaces (a whole flat buffer in the model's dtype against a partition in
    the masters': one rank, or two with 16-bit weights and fp32 masters), else `CopiedResult`."""
    swappable = [
        isinstance(t, FlatParamGroup) and t.flat.device.type == "cpu" and _nbytes(t.flat) <= _nbytes(m)
        for t, m in zip(targets, masters, strict=True)
    ]
    if swappable and all(swappable):
        return SwappedBuffers(targets)
    return CopiedResult(targets, masters)
