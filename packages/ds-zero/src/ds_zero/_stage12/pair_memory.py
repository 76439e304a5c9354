"""ZeRO-1/2 on the two ranks of one host: each reads the other's parameters and gradients where they lie.

[Note: two ranks, one memory] With two gloo ranks on one host (ds_comm.pair_shared_tensor), a flat group's
parameter buffer, and at stage 1 its gradient buffer, live in shared memory each rank owns and its peer
can map. Then:

- the after-step all-gather is one copy of the peer's updated partition out of the peer's own buffer
  (instead of the owner copying it into the pair channel's slot and the peer copying it out again);
- stage 1's reduction is one pass over both ranks' gradients for this rank's partition, `(own + peer's)`
  scaled once, straight into the own partition (instead of the peer copying its piece into the slot and
  this rank adding it into a receive buffer it then scales into the partition).

The result is the same bits as the pair exchange's: `own + peer's` is IEEE's one rounding whichever rank
adds, and the scale is a power of two (RangeReducer's [Note: two ranks sum as they receive]), so DDP's
`(a + b) / 2`. Each exchange sits between two barriers of the shared buffer: the first says every write
of both ranks is done, the second that both are done reading, so each may write its own buffer again
(ds_comm._shm_shared's [Note: the contract]). A buffer ZenFlow swapped out, another dtype or scaling, or
a group the pair memory does not cover keep the collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._stage12.flat_buffer import FlatParamGroup

__all__ = ["gather_from_peer", "reduce_with_peer", "share_for"]

_CHUNK = 1 << 18  # elements summed and scaled while in cache (1 MiB of fp32 per operand)


def share_for(group: ProcessGroup | None) -> Callable[[int, torch.dtype], ds_comm.PairSharedTensor | None] | None:
    """The collective that gives `group`'s flat buffers pair memory (None outside `torch.distributed`)."""
    if not ds_comm.is_initialized():
        return None
    return functools.partial(ds_comm.pair_shared_tensor, group=group)


def shared_params(flat: FlatParamGroup) -> ds_comm.PairSharedTensor | None:
    """`flat`'s pair memory while it still holds the flat buffer (ZenFlow may have swapped in another)."""
    shared = flat.shared
    if shared is None or flat.flat.data_ptr() != shared.mine.data_ptr():
        return None
    return shared


def gather_from_peer(flat: FlatParamGroup, shared: ds_comm.PairSharedTensor) -> None:
    """Copy the peer's updated partition out of its buffer into this rank's (both ranks call it)."""
    peer = 1 - flat.rank
    lo, hi = peer * flat.partition_numel, (peer + 1) * flat.partition_numel
    shared.barrier()  # both partitions are updated
    flat.flat[lo:hi].copy_(shared.peer[lo:hi])
    shared.barrier()  # both are done reading: each may update its own again


def reduce_with_peer(flat: FlatParamGroup, shared: ds_comm.PairSharedTensor, grads: torch.Tensor, scale: float) -> None:
    """This rank's partition of `grads` (its shared gradient buffer) becomes `(own + peer's) * scale`."""
    own = flat.own_slice(grads)
    theirs = flat.own_slice(shared.peer)
    shared.barrier()  # both ranks' gradients are final
    for lo in range(0, own.numel(), _CHUNK):
        piece = own[lo : lo + _CHUNK]
        torch.add(piece, theirs[lo : lo + _CHUNK], out=piece)
        piece.mul_(scale)
    shared.barrier()  # the peer is done reading this rank's gradients
