"""`deepspeed.runtime.comm.coalesced_collectives`: one reduce-scatter for a list of tensors.

`reduce_scatter_coalesced(tensors, group)` gives each rank its partition of the element-wise mean of
every tensor over the group, in one collective. Each tensor is split as DeepSpeed splits it: partitions
of `ceil(numel / world)` elements in rank order, the last ones shorter or empty (7 elements over 2 ranks:
4 and 3; 1 element over 2 ranks: 1 and 0). The tensors' partitions are laid out rank-major in one padded
buffer so a single `reduce_scatter_tensor` moves them all; each rank then cuts its own pieces back out.

`all_to_all_quant_reduce` is ZeRO++'s quantized gradient reduction (qgZ). ds does not implement qgZ (the
`zero_quantized_gradients` key is refused), so only the cases DeepSpeed itself sends down the exact path
are served: a 1-D tensor, or one whose size does not divide by twice the world size. Any other tensor
raises with the reason, rather than returning a layout DeepSpeed's two-hop all-to-all would not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import ds_comm

__all__ = ["all_to_all_quant_reduce", "reduce_scatter_coalesced"]


def _partition_sizes(numel: int, world: int) -> list[int]:
    """DeepSpeed's split of `numel` elements over `world` ranks: ceil-sized pieces, the tail short."""
    chunk = math.ceil(numel / world)
    return [max(0, min(chunk, numel - rank * chunk)) for rank in range(world)]


@torch.no_grad()
def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """This rank's partition of the mean over `group` of each tensor (1-D, in the tensors' dtypes).

    All tensors share one collective; they must share a device and be given in the same order, with the
    same sizes, on every rank. An empty list returns an empty list without communicating.
    """
    if not tensors:
        return []
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    dtype, device = tensors[0].dtype, tensors[0].device
    chunks = [math.ceil(t.numel() / world) for t in tensors]
    per_rank = sum(chunks)
    send = torch.zeros(world * per_rank, dtype=dtype, device=device)
    slots = send.view(world, per_rank)
    offset = 0
    for tensor, chunk in zip(tensors, chunks, strict=True):
        flat = tensor.detach().reshape(-1).to(dtype)
        for r, size in enumerate(_partition_sizes(flat.numel(), world)):
            slots[r, offset : offset + size].copy_(flat[r * chunk : r * chunk + size])
        offset += chunk
    received = torch.empty(per_rank, dtype=dtype, device=device)
    ds_comm.reduce_scatter_tensor(received, send, group=group)
    received.div_(world)
    outputs: list[torch.Tensor] = []
    offset = 0
    for tensor, chunk in zip(tensors, chunks, strict=True):
        size = _partition_sizes(tensor.numel(), world)[rank]
        outputs.append(received[offset : offset + size].to(tensor.dtype).clone())
        offset += chunk
    return outputs


@torch.no_grad()
def all_to_all_quant_reduce(tensors: Sequence[torch.Tensor], groups: dict[str, Any]) -> list[torch.Tensor]:
    """ZeRO++ qgZ's reduction, for the tensors DeepSpeed reduces exactly (see the module docstring).

    Each 1-D tensor, and each whose size is not a multiple of `2 * world_size`, comes back as this rank's
    partition of its mean over the world group, as `reduce_scatter_coalesced` gives it.

    Raises:
        NotImplementedError: a tensor DeepSpeed would quantize (ds has no qgZ), naming its shape.
    """
    world = dist.get_world_size()
    outputs: list[torch.Tensor] = []
    for tensor in tensors:
        if tensor.dim() != 1 and tensor.numel() % (2 * world) == 0:
            raise NotImplementedError(
                f"all_to_all_quant_reduce: a tensor of shape {tuple(tensor.shape)} takes ZeRO++'s quantized "
                "path (qgZ, zero_quantized_gradients), which ds does not implement; use reduce_scatter_coalesced"
            )
        outputs.extend(reduce_scatter_coalesced([tensor]))
    return outputs
