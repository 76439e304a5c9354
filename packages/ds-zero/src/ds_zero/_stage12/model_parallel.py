"""Which elements of this rank's gradient partitions belong to parameters cut across a model-parallel group.

With tensor parallelism a rank's flat buffer holds its shards of the cut parameters and whole copies of
the replicated ones, side by side. The global norm must count each replicated parameter once, so
`ds_ops.precision.finish_step` is told which parts of the partitions are cut (`model_parallel_grads`);
the ranges are fixed at construction, the views are taken at each step (the partitions may be moved,
e.g. by `offload_states`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ds_zero._partition import fragments_in_range
from ds_zero._stage12.flat_buffer import FlatParamGroup

__all__ = ["CutRanges"]


class CutRanges:
    """Per param group, the `(start, numel)` ranges of this rank's partition that hold cut parameters.

    Args:
        flats: the flat param groups (this rank's partition of each).
        cut_params: the parameters cut across the model-parallel group; every other is replicated there.
    """

    def __init__(self, flats: Sequence[FlatParamGroup], cut_params: Collection[torch.Tensor]) -> None:
        cut = {id(p) for p in cut_params}
        self.ranges: list[list[tuple[int, int]]] = []
        for flat in flats:
            slots = [slot for p, slot in zip(flat.params, flat.slots, strict=True) if id(p) in cut]
            start = flat.own_start
            merged: list[tuple[int, int]] = []
            for frag in fragments_in_range(slots, start, start + flat.partition_numel):
                if merged and sum(merged[-1]) == frag.partition_start:  # adjacent: one view
                    merged[-1] = (merged[-1][0], merged[-1][1] + frag.numel)
                else:
                    merged.append((frag.partition_start, frag.numel))
            self.ranges.append(merged)

    def views(self, partitions: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The cut parts of `partitions` (one tensor per group, this rank's gradient partitions), as views."""
        return [view for group in self.group_views(partitions) for view in group]

    def group_views(self, partitions: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """`views`, kept apart per group (for per-group norms)."""
        return [
            [part[start : start + numel] for start, numel in ranges]
            for part, ranges in zip(partitions, self.ranges, strict=True)
        ]
