"""ZenFlow's column selection and selective update on ds-zero's ZeRO-3 shards (`ShardColumns`, `TileTargets`).

[Note: DeepSpeed's layout and ds's] DeepSpeed 0.19.8 stores every 2-D weight transposed at ZeRO-3, so a
rank's partition of `ceil(numel / world)` elements is a run of whole columns (plus the two columns its
boundaries cut); it ranks the whole columns of each rank, all-gathers those sums, picks one top-k per
weight (`ds_zero._zenflow.columns.stage3_columns`) and each rank updates the chosen columns it holds.
ds-zero's shards are row-major (`ds_tensor` is elements `[rank * shard_numel, ...)` of the flattened
weight), so every rank holds a few rows' worth of elements of every column. The same columns are chosen
from the same sums: each rank adds `|gradient|` of its elements into per-column partial sums, one
all-reduce makes them the whole columns' sums, and DeepSpeed's rule (only columns whole inside one of its
transposed partitions, one top-k) picks from them. Adam is elementwise, so updating the chosen columns'
elements where each rank holds them is the same update DeepSpeed makes column by column.

The selective update itself is ds-ops' `ZenFlowSelectiveAdamW`: each parameter's shard is shown to it
as a `(1, count)` proxy (a view of the shard, the model's own storage) whose "columns" are the shard's
elements; `selected_indices` are the positions of the chosen columns' elements in the shard.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ds_zero._params.partitioned_param import state_of
from ds_zero._zenflow.columns import ParamColumns, stage3_columns

logger = logging.getLogger(__name__)

__all__ = ["ShardColumns", "TileTarget", "TileUpdater"]


class ShardColumns:
    """One trainable ZeRO-3 parameter's shard on this rank, as ZenFlow reads and updates it (module note).

    Args:
        param: the partitioned parameter.
        partition: its group's `ShardPartition` (`shard16` is the flat model-dtype buffer of the shards).
        offset: where the shard starts in the partition's flat buffers.
        world_size: the data-parallel world size.
        topk_ratio: `zenflow.topk_ratio`.
    """

    def __init__(self, param: nn.Parameter, partition: object, offset: int, world_size: int, topk_ratio: float):
        st = state_of(param)
        self.param = param
        self.partition = partition
        self.offset = offset
        self.shape = tuple(param.ds_shape)
        numel = int(param.ds_numel)
        start = min(st.rank * st.shard_numel, numel)
        self.count = max(0, min(st.shard_numel, numel - start))
        self.columns: ParamColumns = stage3_columns(self.shape, world_size, topk_ratio, st.name)
        self.is_matrix = len(self.shape) == 2
        #: the column of each element of the shard (2-D parameters only)
        self.column_of = (
            torch.arange(start, start + self.count, dtype=torch.long) % self.shape[1] if self.is_matrix else None
        )
        self.proxy = nn.Parameter(torch.empty(0), requires_grad=False)
        self.proxy.selected_indices = None
        self.proxy.selected_grad = None
        #: the weight's chosen columns (global indices); None until the first selection
        self.selected_columns: torch.Tensor | None = None

    @property
    def num_columns(self) -> int:
        return self.shape[1] if self.is_matrix else 0

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's (unpadded) piece of one of the partition's flat buffers."""
        return flat[self.offset : self.offset + self.count]

    def add_column_sums(self, grad_flat: torch.Tensor, out: torch.Tensor) -> None:
        """Add `|gradient|` of the shard's elements into `out` (one slot per column of the weight)."""
        if self.count:
            out.index_add_(0, self.column_of, self.shard(grad_flat).abs().to(out.dtype))

    def choose(self, sums: torch.Tensor) -> bool:
        """Pick the columns from the whole columns' sums; returns whether the shard's selected size changed."""
        return self.use_columns(self.columns.select_from_sums(sums))

    def use_columns(self, chosen: torch.Tensor) -> bool:
        """Select the weight's columns `chosen` (sorted indices; a checkpoint's or `choose`'s); returns whether
        the shard's selected size changed."""
        mask = torch.zeros(self.num_columns, dtype=torch.bool)
        mask[chosen] = True
        positions = mask[self.column_of].nonzero().squeeze(1) if self.count else torch.zeros(0, dtype=torch.long)
        before = self.proxy.selected_indices
        self.proxy.selected_indices = positions
        self.selected_columns = chosen
        return before is None or before.numel() != positions.numel()

    def owned_positions(self, selective_started: bool) -> torch.Tensor | None:
        """The shard's elements whose truth is the shard, not the fp32 master (the selective step updates
        them there): the selected columns' elements, or, once ZenFlow's selective steps have started, a 1-D
        parameter's whole shard. None when there are none."""
        if self.is_matrix:
            return self.proxy.selected_indices  # type: ignore[attr-defined]  # ZenFlow's input attribute
        return torch.arange(self.count, dtype=torch.long) if selective_started and self.count else None

    def point_at_shard(self) -> nn.Parameter:
        """Point the proxy at the shard (the model's storage) without inputs; returns it. (A checkpoint's
        selective moments are loaded onto proxies of the shard's dtype.)"""
        values = self.shard(self.partition.shard16)
        self.proxy.data = values.view(1, self.count) if self.is_matrix else values
        return self.proxy

    def attach(self, grad_flat: torch.Tensor, scale: float) -> nn.Parameter:
        """Point the proxy at the shard and hang this micro step's `selected_grad` on it; returns the proxy."""
        values = self.shard(self.partition.shard16)  # type: ignore[attr-defined]  # a ShardPartition
        grad = self.shard(grad_flat)
        if self.is_matrix:
            self.proxy.data = values.view(1, self.count)
            selected = grad.index_select(0, self.proxy.selected_indices).view(1, -1)
        else:
            self.proxy.data = values
            selected = grad.clone()
        if scale != 1.0:
            selected.div_(scale)
        # the selective AdamW works in the shard's dtype (the fp32 gradient partition meets 16-bit shards)
        self.proxy.selected_grad = selected.to(values.dtype)
        return self.proxy

    def drop_inputs(self) -> None:
        self.proxy.selected_grad = None
        if hasattr(self.proxy, "temp_selected_param"):
            self.proxy.temp_selected_param = None


class TileTarget:
    """Where the CPU update writes one tile's result: its model-dtype shards (`own_partition`, as at stage 1/2)."""

    def __init__(self, tile: object) -> None:
        shard = tile.shard16()
        assert shard is not None, "ZenFlow at stage 3 needs the shards in one flat buffer (checked at construction)"
        self.own_partition = shard


class TileUpdater:
    """The stage-1/2 partition updater's surface the CPU update uses, over the ZeRO-3 partitions.

    The master is copied into the shards after the step (`copy_back`); the shards are the truth for the
    selected columns, so a reselection reloads the masters from them (`refresh_masters`).
    """

    in_pass_copy = False

    def __init__(self, partitions: list[object], num_tiles: int) -> None:
        self.partitions = partitions
        self.copy_back = [True] * num_tiles

    def refresh_masters(self) -> None:
        for part in self.partitions:
            part.copy_shards_to_master()
