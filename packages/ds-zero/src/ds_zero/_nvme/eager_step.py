"""`EagerSteps`: step each NVMe-swapped sub-group during backward, as soon as its gradient is complete.

[Note: why step in backward] With the optimizer on NVMe a step is bound by the disk: every sub-group's
fp32 master and Adam moments are read and written once (12 bytes per parameter each way), and waiting
for the end of backward leaves the disk idle through the whole backward and adds the gradient's own
round trip (4 bytes per parameter written in backward, read at the step). When nothing needs the whole
gradient before any update (no clipping, no inf/nan check, loss scale 1) and this backward ends the
accumulation window, a sub-group can be updated the moment its last gradient piece arrives: its state
is read ahead while earlier layers' backward computes, the update uses the gradient still in memory,
and the write overlaps the rest of backward (with `pipeline_read`/`pipeline_write`, as in `step()`).
The result is the same update `step()` would make (same gradient, same hyper-parameters, same order of
operations within the sub-group).

The sub-groups are expected in the order the previous backward completed them (recorded by the
`GradSwapper`); one that completes out of that order is simply left for `step()` (its gradient goes to
disk as usual), as is every sub-group after it. The caller (`DeepSpeedZeroOptimizer_Stage3`) decides when
eager stepping is allowed and steps the rest at `step()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ds_zero._nvme.optimizer_swapper import OptimizerSwapper
    from ds_zero._stage3.partition import ShardTile

__all__ = ["EagerSteps"]


class EagerSteps:
    """Steps the sub-groups of `order` one by one as `offer` hands over their complete gradients.

    Args:
        swapper: the optimizer swapper (its buffer sets, reader and writer are used as in `step()`).
        order: the sub-groups in the order their gradients are expected to complete.
        step_fn: updates one bound sub-group (the base optimizer's step on it and its 16-bit shards).
    """

    def __init__(self, swapper: OptimizerSwapper, order: list[ShardTile], step_fn: Callable[[ShardTile], None]):
        self.swapper = swapper
        self.order = [t for t in order if t.numel]
        self.step_fn = step_fn
        self.pos = 0
        self.stepped: set[int] = set()
        self._ahead: list[Any] | None = None
        self._pending_write: tuple[ShardTile, list[Any]] | None = None
        self.active = True

    def start(self) -> None:
        """Begin reading the first expected sub-group's master and state (overlaps the start of backward)."""
        if self.order and self.swapper.pipeline_read:
            self._ahead = self.swapper._issue_reads(self.order[0], 0, with_grad=False)

    def offer(self, tile: ShardTile, grad: torch.Tensor) -> bool:
        """Step `tile` now with `grad` (its complete fp32 gradient) if it is the next expected; else False."""
        if not self.active or self.pos >= len(self.order) or self.order[self.pos] is not tile:
            self.active = False  # out of the recorded order: the rest waits for step()
            return False
        sw = self.swapper
        set_index = self.pos % sw.num_sets
        reads = self._ahead if self._ahead is not None else sw._issue_reads(tile, set_index, with_grad=False)
        sw._wait(sw.reader, "read", [r for r, _, _ in reads])
        self._ahead = None
        if sw.pipeline_read and self.pos + 1 < len(self.order):
            self._ahead = sw._issue_reads(self.order[self.pos + 1], (self.pos + 1) % sw.num_sets, with_grad=False)
        sw._bind(tile, set_index, reads, with_grad=False)
        tile.master.grad = grad
        self.step_fn(tile)
        tile.master.grad = None
        writes = sw._issue_writes(tile)
        self._settle_write()
        self._pending_write = (tile, writes)
        if not sw.pipeline_write:  # its buffer set is needed again right away
            self._settle_write()
        self.stepped.add(tile.index)
        self.pos += 1
        return True

    def _settle_write(self) -> None:
        if self._pending_write is not None:
            tile, writes = self._pending_write
            self._pending_write = None
            self.swapper._wait(self.swapper.writer, "write", [r for r, _, _ in writes])
            self.swapper._unbind(tile, writes)

    def finish(self) -> None:
        """End of backward: the last write lands, a read-ahead nobody took is dropped."""
        self.active = False
        if self._ahead is not None:
            self._ahead = None
            self.swapper._wait(self.swapper.reader, "read", [])
        self._settle_write()
