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

    def _deepspeed_param_ids(self) -> dict[int, int]:
        ids: dict[int, int] = {}
        for f in self.flats:
            for p in f.params:
                ids.setdefault(id(p), len(ids))
        return ids

    def get_param_id(self, param: torch.Tensor) -> int:
        """DeepSpeed's id of a trainable parameter: its position counting over the param groups in order.

        Raises:
            ValueError: `param` is not one of the parameters this optimizer partitions.
        """
        found = self._deepspeed_param_ids().get(id(param))
        if found is None:
            raise ValueError(
                f"get_param_id: the parameter of shape {tuple(param.shape)} is not one this ZeRO optimizer partitions"
            )
        return found

    @property
    def param_to_partition_ids(self) -> list[dict[int, list[int]]]:
        """Per param group, DeepSpeed's map: param id -> the data-parallel ranks whose partition of the flat
        buffer holds part of the parameter (more than one for a parameter that straddles a boundary)."""
        ids = self._deepspeed_param_ids()
        maps: list[dict[int, list[int]]] = []
        for f in self.flats:
            where: dict[int, list[int]] = {}
            for p, slot in zip(f.params, f.slots, strict=True):
                if slot.numel == 0 or f.partition_numel == 0:
                    continue
                first = slot.flat_offset // f.partition_numel
                last = (slot.flat_offset + slot.numel - 1) // f.partition_numel
                where[ids[id(p)]] = list(range(first, last + 1))
            maps.append(where)
        return maps
