"""ZeRO-1/2 on the two ranks of one host: each reads the other's parameters and gradients where they lie.

[Note: two ranks, one memory] With two gloo ranks on one host (ds_comm.pair_shared_tensor), a flat group's
parameter buffer, and at stage 1 its gradient buffer, live in shared memory each rank owns and its peer
can map. Then:

- the after-step all-gather is one copy of the peer's updated partition out of the peer's own buffer
  (instead of the owner copying it into the pair channel's slot and the peer copying it out again);
- stage 1's reduction is one pass over both ranks' gradients for this rank's partition, `(own + peer's)`
  scaled once, straight into the own partition (instead of the peer copying its piece into the slot and
  this rank adding it into a receive buffer it then scales into the partition);
- stage 2 stages each bucket at its place in a flat gradient buffer in pair memory, and the owner of a
  piece sums it out of both ranks' buffers into its fp32 partition (`PairBuckets`).

The result is the same bits as the pair exchange's: `own + peer's` is IEEE's one rounding whichever rank
adds, and the scale is a power of two (RangeReducer's [Note: two ranks sum as they receive]), so DDP's
`(a + b) / 2`. Each exchange sits between two barriers of the shared buffer: the first says every write
of both ranks is done, the second that both are done reading, so each may write its own buffer again
(ds_comm._shm_shared's [Note: the contract]). A buffer ZenFlow swapped out, another dtype or scaling, or
a group the pair memory does not cover keep the collectives.

[Note: stage 2's counters] Stage 2 reduces bucket by bucket during the backward, so two barriers per
exchange would stall the faster rank at every bucket. Each rank instead counts, per group, the buckets it
launched (its writes are final) and the buckets it completed (it has read the peer's), in the same order
on both ranks. Completing bucket number n waits until the peer launched n; staging a bucket in the next
backward waits until the peer completed that bucket's previous number (it read the old contents). The
peer completes every bucket by the end of its backward, which needs nothing of this rank's later
backwards, so neither wait can close a cycle.

[Note: the own piece is never staged] Only the peer reads a bucket's staging, and only the part in its
own partition. So the part of a gradient in this rank's partition is not copied into the staging at all:
the bucket keeps the gradient (autograd's tensor, dropped from `.grad`) and its completion sums it with the
peer's staging straight into the partition, one pass where a copy and a pass were. Where the partition is
logically zero (the first backward since `zero_grad()`), completion writes the sum over it instead of
adding, so `zero_grad()` need not clear it first (BucketReducer's [Note: clearing by overwriting]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._stage12.flat_buffer import FlatParamGroup

__all__ = ["PairBuckets", "gather_from_peer", "gradient_memory", "pair_buckets", "reduce_with_peer", "share_for"]

_CHUNK = 1 << 18  # elements summed and scaled while in cache (1 MiB of fp32 per operand)
_WRITTEN, _READ = 1, 2  # stage 2's counters (ds_comm.PairSharedTensor.post / wait_for)


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


class PairBuckets:
    """Stage 2's buckets of one fp32 group, staged in pair memory (the module's [Note: stage 2's counters] and
    [Note: the own piece is never staged])."""

    def __init__(self, shared: ds_comm.PairSharedTensor) -> None:
        self.shared = shared
        self.launched = 0
        self.completed = 0
        self._sum = torch.empty(_CHUNK, dtype=shared.mine.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.shared.mine.dtype

    def stage(self, start: int, end: int, last_seq: int) -> torch.Tensor:
        """Where a bucket over flat range `[start, end)` is staged, once the peer has read its previous
        contents (the bucket's launch number `last_seq`; 0: never launched)."""
        self.shared.wait_for(_READ, last_seq, f"read this rank's gradient bucket {last_seq}")
        return self.shared.mine[start:end]

    def launch(self) -> int:
        """The next bucket's writes are final: its launch number."""
        self.launched += 1
        self.shared.post(_WRITTEN, self.launched)
        return self.launched

    def launched_by_peer(self, seq: int) -> bool:
        """Whether the peer has launched bucket `seq` (its writes are final): `complete` would not wait."""
        return self.shared.peer_reached(_WRITTEN, seq)

    def complete(
        self,
        flat: FlatParamGroup,
        seq: int,
        own: list[tuple[int, torch.Tensor]],
        accumulator: torch.Tensor,
        scale: float,
        *,
        overwrite: bool,
    ) -> None:
        """Put `(own + peer's) * scale` of bucket `seq` into this rank's part of it in `accumulator` (its fp32
        partition): added, or written over it where `overwrite` (the partition is logically zero). `own` is
        this rank's values of that part, as `(flat index, values)` pieces that tile it (the gradients
        themselves, or their staging). The pair exchange's sum and RangeReducer's addition, bit for bit."""
        self.shared.wait_for(_WRITTEN, seq, f"write its gradient bucket {seq}")
        base = flat.own_start
        for start, values in own:
            for lo in range(0, values.numel(), _CHUNK):
                n = min(_CHUNK, values.numel() - lo)
                at = start + lo
                total, out = self._sum[:n], accumulator[at - base : at - base + n]
                torch.add(values[lo : lo + n], self.shared.peer[at : at + n], out=total)
                if overwrite:
                    torch.mul(total, scale, out=out)
                else:
                    out.add_(total, alpha=scale)
        self.completed += 1
        self.shared.post(_READ, self.completed)


def gradient_memory(
    share: Callable[[int, torch.dtype], ds_comm.PairSharedTensor | None] | None, flat: FlatParamGroup, eligible: bool
) -> ds_comm.PairSharedTensor | None:
    """Pair memory laid out like `flat` for its gradients, where the reduction allows it (`eligible`: two gloo
    ranks, a power-of-two average, fp32 communication), `flat` is fp32 on the CPU and both ranks could map
    it; else None, the pair exchange. Called alike on both ranks (`share` is a collective)."""
    if share is None or not eligible or flat.dtype != torch.float32 or flat.device.type != "cpu":
        return None
    return share(flat.padded_numel, flat.dtype)


def pair_buckets(
    share: Callable[[int, torch.dtype], ds_comm.PairSharedTensor | None] | None, flat: FlatParamGroup, eligible: bool
) -> PairBuckets | None:
    """Stage 2's staging for `flat` in pair memory (`gradient_memory`), or None."""
    shared = gradient_memory(share, flat, eligible)
    return PairBuckets(shared) if shared is not None else None
