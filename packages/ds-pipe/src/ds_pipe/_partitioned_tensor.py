"""`PartitionedTensor`: a tensor kept as one contiguous slice of its elements per rank of a group.

A pipeline stage whose activations are replicated across a tensor-parallel group need not send (or
keep) the whole tensor from every rank: each rank keeps the slice `partition_uniform` gives it, sends
that slice with a small meta tensor (`to_meta`), and the receiver rebuilds the object with `from_meta`
and all-gathers the full tensor when it needs it (`full`). This is DeepSpeed's
`deepspeed.runtime.utils.PartitionedTensor`; the meta layout is DeepSpeed's too, so the two agree on it:
`[ndim, *shape, num_parts, rank, *boundaries]` as a `torch.long` tensor, where `boundaries` are the
`num_parts + 1` element offsets of the slices (a CSR row pointer).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import ds_comm
from ds_pipe._partition import partition_uniform

__all__ = ["PartitionedTensor"]


class PartitionedTensor:
    """This rank's slice of `tensor`'s flattened elements across `group` (default: the world).

    Every rank of `group` must construct it from the same full tensor (same shape, dtype); `full()`
    is a collective over `group`. Without an initialised process group the world is this process.

    Attributes:
        group: the process group the slices are spread over.
        num_parts: its size. rank: this process's rank in it.
        orig_size: the full tensor's shape (a list). orig_device: where `full()` puts it by default.
        local_data: this rank's slice (1-D, a copy). partition: the `num_parts + 1` slice boundaries.
        even_split: whether every slice has the same length.
    """

    def __init__(self, tensor: torch.Tensor, group: Any = None) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"PartitionedTensor: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self.group = group
        self.num_parts = ds_comm.get_world_size(group)
        self.rank = ds_comm.get_rank(group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(num_items=tensor.numel(), num_parts=self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:stop].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(
        cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any = None, device: Any = None
    ) -> PartitionedTensor:
        """The object another rank described with `to_meta()`, holding `local_part` as this rank's slice.

        Raises:
            ValueError: `meta` is not a long tensor in `to_meta`'s layout, or was written for a group of
                another size or by a rank other than this one's position in `group`.
        """
        if not isinstance(meta, torch.Tensor) or meta.dtype != torch.long:
            raise ValueError(f"PartitionedTensor.from_meta: meta must be a torch.long tensor, got {meta!r}")
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        shape, rest = values[1 : 1 + ndim], values[1 + ndim :]
        num_parts, rank, boundaries = rest[0], rest[1], rest[2:]
        world, my_rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        if (num_parts, rank) != (world, my_rank) or len(boundaries) != num_parts + 1:
            raise ValueError(
                f"PartitionedTensor.from_meta: meta describes rank {rank} of {num_parts} parts "
                f"({len(boundaries)} boundaries), but this is rank {my_rank} of a group of {world}"
            )
        obj = cls.__new__(cls)
        obj.group, obj.num_parts, obj.rank = group, num_parts, rank
        obj.orig_size = shape
        obj.orig_device = torch.device(device) if device is not None else local_part.device
        obj.partition = boundaries
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(shape) % num_parts == 0
        return obj

    def to_meta(self) -> torch.Tensor:
        """The partitioning as a `torch.long` tensor on `orig_device` (send it beside `data()`)."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, all-gathered over `group` (a collective: every rank calls it)."""
        device = self.orig_device if device is None else torch.device(device)
        if self.num_parts == 1:
            return self.local_data.to(device).clone().view(self.orig_size)
        # One all-gather of equal-length chunks: uneven slices are padded to the longest one.
        lengths = [self.partition[i + 1] - self.partition[i] for i in range(self.num_parts)]
        chunk = max(lengths)
        padded = torch.zeros(chunk, dtype=self.local_data.dtype, device=device)
        padded[: self.local_data.numel()].copy_(self.local_data)
        gathered = torch.empty(chunk * self.num_parts, dtype=self.local_data.dtype, device=device)
        ds_comm.all_gather_into_tensor(gathered, padded, group=self.group)
        if not self.even_split:
            gathered = torch.cat([gathered[i * chunk : i * chunk + n] for i, n in enumerate(lengths)])
        return gathered.view(self.orig_size)

    def data(self) -> torch.Tensor:
        """This rank's slice (what to send beside `to_meta()`)."""
        return self.local_data

    def local_size(self) -> torch.Size:
        """The shape of this rank's slice (1-D)."""
        return self.local_data.size()

    def full_size(self) -> list[int]:
        """The full tensor's shape."""
        return self.orig_size
