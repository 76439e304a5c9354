"""DeepSpeed's names for the stage-1/2 optimizer's flat buffers and partitions, as views of ds's own.

DeepSpeed's tests and users' tools read these attributes of its `DeepSpeedZeroOptimizer`; here each is a view
of a `FlatParamGroup` or of the fp32 masters, so reading one costs nothing and writing one writes ds's state.
"""

from __future__ import annotations

import torch

from ds_zero._stage12.flat_buffer import FlatParamGroup

__all__ = ["NCCL_START_ALIGNMENT_FACTOR", "FlatBufferViews"]

#: DeepSpeed's `nccl_start_alignment_factor`: 16-bit elements per 4 bytes, the granularity its stage-1/2
#: all-gather buffers start at; `allgather_bucket_size` must be a multiple of it there, as in DeepSpeed.
NCCL_START_ALIGNMENT_FACTOR = 2


class FlatBufferViews:
    """Mixin for `DeepSpeedZeroOptimizer` (uses its `flats` and `masters`)."""

    flats: list[FlatParamGroup]
    masters: list[torch.Tensor]

    nccl_start_alignment_factor = NCCL_START_ALIGNMENT_FACTOR

    @property
    def bit16_groups_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's name of the flat model-dtype buffers, one per param group: every trainable parameter
        of the group is a view of it (padded to a multiple of the data-parallel size), on the parameters'
        device. Not part of autograd (`grad_fn` is None), so in-place partition updates are safe."""
        return [f.flat for f in self.flats]

    @property
    def parallel_partitioned_bit16_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, every data-parallel rank's partition of the flat buffer (views, rank order).

        ds pads a flat buffer to a multiple of the world size, where DeepSpeed pads to `2 * world`
        (`nccl_start_alignment_factor`), so a 16-bit partition here may start 2-byte, not 4-byte, aligned.
        """
        return [[f.partition(rank) for rank in range(f.num_partitions)] for f in self.flats]

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """DeepSpeed's name of the fp32 master partitions, one per param group (`masters`; the base optimizer's
        params and its state keys)."""
        return self.masters
