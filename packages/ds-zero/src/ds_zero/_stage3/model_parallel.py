"""Which elements of this rank's stage-3 gradient partitions belong to parameters cut across a model-parallel group.

With tensor parallelism (AutoTP) each rank's shards of the cut parameters and its shards of the
replicated ones lie side by side in a `ShardPartition`'s flat gradient, at fixed offsets. The global
norm must count each replicated parameter once over the tensor-parallel ranks, so
`ds_ops.precision.finish_step` is told which parts are cut (`model_parallel_grads`), as the stage 1/2
optimizer tells it (`ds_zero._stage12.model_parallel`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ds_zero._stage3.partition import ShardPartition

__all__ = ["Stage3CutRanges"]


class Stage3CutRanges:
    """Per partition (param group), the `(offset, numel)` ranges of its flat gradient that hold cut parameters."""

    def __init__(self, partitions: Sequence[ShardPartition], cut_params: Collection[torch.Tensor]) -> None:
        cut = {id(p) for p in cut_params}
        self.ranges = [
            [(off, size) for p, off, size in zip(part.params, part.offsets, part.sizes, strict=True) if id(p) in cut]
            for part in partitions
        ]

    def group_views(self, grads: Sequence[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """Per partition, views of its cut parts in `grads` (each partition's flat gradient, or None)."""
        return [
            [] if grad is None else [grad[off : off + size] for off, size in ranges]
            for grad, ranges in zip(grads, self.ranges, strict=True)
        ]

    def views(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """`group_views`, flattened into one list."""
        return [view for group in self.group_views(grads) for view in group]
