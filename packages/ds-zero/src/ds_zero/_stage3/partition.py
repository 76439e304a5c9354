"""One param group's slice of the stage-3 optimizer on this rank: the flat fp32 master over the group's shards.

Each partitioned parameter contributes its shard (`ds_tensor`, `ceil(numel / N)` elements) to its
group's flat partition, in parameter order. The shards are re-pointed into one flat buffer of the model
dtype (so the step can write them in one pass); in fp32 training without optimizer offload that buffer
*is* the fp32 master, so there is no second copy. The master's `.grad` is the flat fp32 gradient
partition the reduce-scatters add into.

The partition is cut into *tiles* of at most `sub_group_size` elements, on parameter boundaries (a
larger shard is a tile of its own). Each tile is a view of the master and is one parameter of the base
optimizer, stepped one at a time, so the step's temporaries are bounded by the tile size; in the
checkpoint format each tile is one partition.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_zero._host_buffers import offload_zeros
from ds_zero._params.partitioned_param import state_of
from ds_zero._params.shards import shard_values, write_shards
from ds_zero._partition import Fragment, ParamSlot
from ds_zero._stage3.partition_index import PartitionIndex

logger = logging.getLogger(__name__)

__all__ = ["ShardPartition", "ShardTile", "shard_fragments"]


def shard_fragments(params: list[nn.Parameter], offsets: list[int]) -> list[Fragment]:
    """The checkpoint fragments of this rank's shards placed at `offsets` of a flat partition."""
    frags = []
    for p, off in zip(params, offsets, strict=True):
        start = min(state_of(p).rank * state_of(p).shard_numel, p.ds_numel)
        count = max(0, min(state_of(p).shard_numel, p.ds_numel - start))
        if count:
            frags.append(Fragment(state_of(p).name, start, count, off))
    return frags


class ShardTile:
    """Elements `[start, end)` of a partition: a run of whole shards, one base-optimizer parameter."""

    def __init__(self, part: ShardPartition, start: int, end: int, first: int, last: int) -> None:
        self.partition = part
        self.group_index = part.group_index
        self.start, self.end = start, end
        self.numel = end - start
        self.params = part.params[first:last]
        self.offsets = [off - start for off in part.offsets[first:last]]
        self.swap: Any = None  # the OptimizerSwapper when the master lives on NVMe
        self.index = -1  # position among the base optimizer's parameters (set by the swapper)
        if part.swap_master:  # its own tensor, whose data the swapper points at a buffer during the step
            self.master = torch.full((1,), float("nan"), dtype=part.master_dtype).expand(self.numel)
        else:
            self.master = part.master[start:end] if part.master is not None else None

    def fragments(self) -> list[Fragment]:
        return shard_fragments(self.params, self.offsets)

    def param_shapes(self) -> dict[str, list[int]]:
        return {state_of(p).name: list(p.ds_shape) for p in self.params}

    def attach_grad(self) -> None:
        """Point the tile's `.grad` at its slice of the partition's gradient (None when there is none)."""
        grad = self.partition.master.grad
        self.master.grad = None if grad is None else grad[self.start : self.end]

    def fp32_values(self) -> torch.Tensor:
        """A fresh fp32 copy of the tile's values."""
        if self.swap is not None:
            return self.swap.read_master(self).to(torch.float32)
        if self.master is not None:
            return self.master.detach().to(torch.float32, copy=True)
        return self.shard_fp32_values()

    def model_values(self) -> torch.Tensor:
        """A fresh copy of the tile's shards in the model dtype, each at its offset (zeros between them)."""
        dtype = state_of(self.params[0]).full.dtype if self.params else torch.float32
        out = torch.zeros(self.numel, dtype=dtype)
        for p, off in zip(self.params, self.offsets, strict=True):
            out[off : off + state_of(p).shard_numel].copy_(shard_values(p))
        return out

    def shard_fp32_values(self) -> torch.Tensor:
        """The tile's model-dtype shards (read from NVMe when swapped), as fp32."""
        out = torch.empty(self.numel, dtype=torch.float32)
        for p, off in zip(self.params, self.offsets, strict=True):
            out[off : off + state_of(p).shard_numel].copy_(shard_values(p))
        return out

    def load_fp32_values(self, values: torch.Tensor) -> None:
        """Set the tile (master and shards) from fp32 `values` of its layout."""
        with torch.no_grad():
            if self.swap is not None:
                self.swap.write_master(self, values)
            elif self.master is not None:
                self.master.copy_(values)
            write_shards(
                self.params,
                [values[off : off + state_of(p).shard_numel] for p, off in zip(self.params, self.offsets, strict=True)],
            )

    def shard16(self) -> torch.Tensor | None:
        """The model-dtype view of the tile (None when the shards are not one flat buffer)."""
        flat = self.partition.shard16
        return None if flat is None else flat[self.start : self.end]


class ShardPartition:
    """The flat partition (fp32 master + model-dtype shards) of one group's partitioned parameters.

    Args:
        group_index: the base optimizer param group (-1 for the frozen parameters' partition).
        params: the group's partitioned parameters, in order.
        master_device: where the fp32 master lives (None: where the shards are; "cpu" for offload).
        master_dtype: the master's (and its gradient's) dtype: fp32, or bf16 with `bf16_master_weights_and_grads`
            (then, over bf16 shards, the master is the shards' flat buffer itself, as for fp32 training).
        with_master: build the fp32 master (False for frozen parameters).
        pin_master: page-lock a host master (offload_optimizer.pin_memory; see ds_zero._host_buffers).
        index: the optimizer's `PartitionIndex`, told where each parameter's master slice and gradient slot
            are (with a master only).
        sub_group_size: elements per tile (see the module docstring).
        own_master: always give the master its own buffer, even where the shards' flat buffer could be it
            (ZenFlow updates the shards between CPU updates, so the two must differ).
    """

    def __init__(
        self,
        group_index: int,
        params: list[nn.Parameter],
        *,
        master_device: torch.device | None,
        master_dtype: torch.dtype = torch.float32,
        with_master: bool = True,
        sub_group_size: int = 1_000_000_000,
        swap_master: bool = False,
        pin_master: bool = False,
        index: PartitionIndex | None = None,
        own_master: bool = False,
    ) -> None:
        self.group_index = group_index
        self.own_master = own_master
        self.master_dtype = master_dtype
        self.swap_master = swap_master and with_master
        self.params = params
        self.sizes = [state_of(p).shard_numel for p in params]
        self.offsets = []
        total = 0
        for s in self.sizes:
            self.offsets.append(total)
            total += s
        self.numel = total
        self.shard16 = self._flatten_shards()
        self.master: torch.Tensor | None = None
        if self.swap_master:
            # the masters live in the tiles' swap files; this shape-only tensor carries the gradient partition
            self.master = torch.full((1,), float("nan"), dtype=self.master_dtype).expand(total)
            if index is not None:
                for p, off in zip(params, self.offsets, strict=True):
                    index.add(p, grad_flat=self.master, grad_offset=off, master=None)
        elif with_master:
            self.master = self._make_master(master_device, pin_master)
            if index is not None:
                for p, off, s in zip(params, self.offsets, self.sizes, strict=True):
                    index.add(p, grad_flat=self.master, grad_offset=off, master=self.master[off : off + s])
        self.tiles = self._cut(max(1, sub_group_size))

    def _cut(self, tile_numel: int) -> list[ShardTile]:
        if not self.params:
            return [ShardTile(self, 0, 0, 0, 0)]
        tiles = []
        first = 0
        for i in range(1, len(self.params) + 1):
            end = self.offsets[i] if i < len(self.params) else self.numel
            nxt = self.sizes[i] if i < len(self.params) else 0
            if i == len(self.params) or end - self.offsets[first] + nxt > tile_numel:
                tiles.append(ShardTile(self, self.offsets[first], end, first, i))
                first = i
        return tiles

    def _flatten_shards(self) -> torch.Tensor | None:
        """Re-point every shard into one flat buffer when they share dtype and device."""
        if not self.params or any(state_of(p).swap is not None for p in self.params):
            return None  # shards on NVMe are written one by one from the master
        kinds = {(p.ds_tensor.dtype, p.ds_tensor.device) for p in self.params}
        if len(kinds) != 1:
            return None
        dtype, device = kinds.pop()
        first = self.params[0].ds_tensor
        base = first.untyped_storage().data_ptr()
        item = first.element_size()
        if (
            all(
                p.ds_tensor.untyped_storage().data_ptr() == base
                and p.ds_tensor.is_contiguous()
                and p.ds_tensor.storage_offset() == first.storage_offset() + off
                for p, off in zip(self.params, self.offsets, strict=True)
            )
            and item
        ):
            # the shards already lie back to back in one buffer (partitioned together): view it, no copy
            return first.as_strided((self.numel,), (1,), first.storage_offset())
        flat = torch.empty(self.numel, dtype=dtype, device=device)
        if any(ds_comm.get_accelerator().is_pinned(p.ds_tensor) for p in self.params):
            flat = ds_comm.get_accelerator().pin_memory(flat)
        with torch.no_grad():
            for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                flat[off : off + s].copy_(p.ds_tensor)
                p.ds_tensor = flat[off : off + s]
        return flat

    def _make_master(self, device: torch.device | None, pin: bool) -> torch.Tensor:
        flat = self.shard16
        if (
            not self.own_master
            and flat is not None
            and flat.dtype == self.master_dtype
            and (device is None or flat.device == device)
        ):
            return flat
        if device is None:
            device = (
                flat.device
                if flat is not None
                else (self.params[0].ds_tensor.device if self.params else torch.device("cpu"))
            )
        if device.type == "cpu":  # pinned, or huge pages the CPU optimizer streams faster (ds_zero._host_buffers)
            master = offload_zeros(self.numel, pin_memory=pin, dtype=self.master_dtype)
        else:
            master = torch.empty(self.numel, dtype=self.master_dtype, device=device)
        with torch.no_grad():
            for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                master[off : off + s].copy_(shard_values(p))
        return master

    @property
    def master_is_shard(self) -> bool:
        return self.master is not None and self.master is self.shard16

    def copy_shards_to_master(self) -> None:
        """The model-dtype shards into the fp32 master (restore from 16-bit weights)."""
        if self.master is None or self.master_is_shard:
            return
        if self.swap_master:
            for tile in self.tiles:
                tile.swap.write_master(tile, tile.shard_fp32_values())
            return
        with torch.no_grad():
            for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                self.master[off : off + s].copy_(shard_values(p))

    @property
    def slots(self) -> list[ParamSlot]:
        """The partition's parameters (name, full shape, offset of this rank's shard, full numel)."""
        return [
            ParamSlot(state_of(p).name, tuple(p.ds_shape), off, p.ds_numel)
            for p, off in zip(self.params, self.offsets, strict=True)
        ]

    def param_shapes(self) -> dict[str, list[int]]:
        return {state_of(p).name: list(p.ds_shape) for p in self.params}
