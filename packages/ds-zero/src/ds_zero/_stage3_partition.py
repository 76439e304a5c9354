"""One param group's slice of the stage-3 optimizer on this rank: the flat fp32 master over the group's shards.

Each partitioned parameter contributes its shard (`ds_tensor`, `ceil(numel / N)` elements) to its
group's flat partition, in parameter order. The shards are re-pointed into one flat buffer of the model
dtype (so the step can write them in one pass); in fp32 training without optimizer offload that buffer
*is* the fp32 master, so there is no second copy. The master's `.grad` is the flat fp32 gradient
partition the reduce-scatters add into.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import ds_comm
from ds_zero._partition import Fragment, ParamSlot

logger = logging.getLogger(__name__)

__all__ = ["ShardPartition", "shard_fragments"]


def shard_fragments(params: list[nn.Parameter], offsets: list[int]) -> list[Fragment]:
    """The checkpoint fragments of this rank's shards placed at `offsets` of a flat partition."""
    frags = []
    for p, off in zip(params, offsets, strict=True):
        start = min(p.ds_rank * p.ds_shard_numel, p.ds_numel)
        count = max(0, min(p.ds_shard_numel, p.ds_numel - start))
        if count:
            frags.append(Fragment(p.ds_name, start, count, off))
    return frags


class ShardPartition:
    """The flat partition (fp32 master + model-dtype shards) of one group's partitioned parameters.

    Args:
        group_index: the base optimizer param group (-1 for the frozen parameters' partition).
        params: the group's partitioned parameters, in order.
        master_device: where the fp32 master lives (None: where the shards are; "cpu" for offload).
        with_master: build the fp32 master (False for frozen parameters).
    """

    def __init__(self, group_index: int, params: list[nn.Parameter], *, master_device: torch.device | None,
                 with_master: bool = True) -> None:
        self.group_index = group_index
        self.params = params
        self.sizes = [p.ds_shard_numel for p in params]
        self.offsets = []
        total = 0
        for s in self.sizes:
            self.offsets.append(total)
            total += s
        self.numel = total
        self.shard16 = self._flatten_shards()
        self.master: torch.Tensor | None = None
        if with_master:
            self.master = self._make_master(master_device)
            for p, off, s in zip(params, self.offsets, self.sizes, strict=True):
                p._ds_master = self.master[off: off + s]
                p._ds_grad_slot = (self.master, off)

    def _flatten_shards(self) -> torch.Tensor | None:
        """Re-point every shard into one flat buffer when they share dtype and device."""
        if not self.params:
            return None
        kinds = {(p.ds_tensor.dtype, p.ds_tensor.device) for p in self.params}
        if len(kinds) != 1:
            return None
        dtype, device = kinds.pop()
        flat = torch.empty(self.numel, dtype=dtype, device=device)
        if any(ds_comm.get_accelerator().is_pinned(p.ds_tensor) for p in self.params):
            flat = ds_comm.get_accelerator().pin_memory(flat)
        with torch.no_grad():
            for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                flat[off: off + s].copy_(p.ds_tensor)
                p.ds_tensor = flat[off: off + s]
        return flat

    def _make_master(self, device: torch.device | None) -> torch.Tensor:
        flat = self.shard16
        if flat is not None and flat.dtype == torch.float32 and (device is None or flat.device == device):
            return flat
        if device is None:
            device = flat.device if flat is not None else (self.params[0].ds_tensor.device if self.params
                                                           else torch.device("cpu"))
        master = torch.empty(self.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                master[off: off + s].copy_(p.ds_tensor)
        return master

    @property
    def master_is_shard(self) -> bool:
        return self.master is not None and self.master is self.shard16

    def copy_master_to_shards(self) -> None:
        """After the step: the updated fp32 values into the model-dtype shards (no-op when they are one)."""
        if self.master is None or self.master_is_shard:
            return
        with torch.no_grad():
            if self.shard16 is not None:
                self.shard16.copy_(self.master, non_blocking=True)
            else:
                for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                    p.ds_tensor.copy_(self.master[off: off + s])

    def copy_shards_to_master(self) -> None:
        """The model-dtype shards into the fp32 master (restore from 16-bit weights)."""
        if self.master is None or self.master_is_shard:
            return
        with torch.no_grad():
            for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                self.master[off: off + s].copy_(p.ds_tensor)

    def fp32_values(self) -> torch.Tensor:
        """A fresh fp32 copy of this partition (masters, or the shards for a frozen partition)."""
        if self.master is not None:
            return self.master.detach().to(torch.float32, copy=True)
        out = torch.empty(self.numel, dtype=torch.float32)
        for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
            out[off: off + s].copy_(p.ds_tensor)
        return out

    def load_fp32_values(self, values: torch.Tensor) -> None:
        """Set the partition (master and shards) from fp32 `values` of this layout."""
        with torch.no_grad():
            if self.master is not None:
                self.master.copy_(values)
                self.copy_master_to_shards()
            else:
                for p, off, s in zip(self.params, self.offsets, self.sizes, strict=True):
                    p.ds_tensor.copy_(values[off: off + s])

    def fragments(self) -> list[Fragment]:
        return shard_fragments(self.params, self.offsets)

    @property
    def slots(self) -> list[ParamSlot]:
        """The partition's parameters (name, full shape, offset of this rank's shard, full numel)."""
        return [ParamSlot(p.ds_name, tuple(p.ds_shape), off, p.ds_numel)
                for p, off in zip(self.params, self.offsets, strict=True)]

    def param_shapes(self) -> dict[str, list[int]]:
        return {p.ds_name: list(p.ds_shape) for p in self.params}
