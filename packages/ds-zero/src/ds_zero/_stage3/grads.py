"""Stage-3 gradients: reduce-scatter each full gradient into its owner's fp32 partition as it is produced.

The trainable partitioned parameters are split once into fixed buckets of about `reduce_bucket_size`
elements, in reverse registration order (roughly the order backward produces gradients). A
post-accumulate-grad hook records each arriving full gradient; bucket k is reduce-scattered, in one
asynchronous collective that overlaps the rest of backward, as soon as all its gradients are in and
buckets 0..k-1 are issued; at the end of backward the remaining buckets go in order, with zeros for
parameters that got no gradient. So every rank issues the same reduce-scatters, of the same sizes, in the
same order, whatever its graph produced: a data-dependent difference can never pair two different
collectives. With `overlap_comm` (the stage-3 default) one bucket stays in flight while backward goes on
and the next fills; without it each reduce-scatter is waited for as soon as it is issued (no overlap, and
its staging buffer freed at once): the same collectives and the same sums either way. The input is
rank-major (`[rank 0: shard 0 of each param | rank 1: shard 1 | ...]`) so the output is this rank's shards
back to back; each is averaged and added into the fp32 gradient of its master partition (accumulating
across micro-steps), and each full gradient is dropped once copied. A bucket holds one placement family
(`ds_zero._params.placement`): AutoEP expert buckets are reduce-scattered over their expert-data-parallel
group and, like the others, divided by the data-parallel world size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._buffer_pool import BufferPool
from ds_zero._params.partitioned_param import state_of, storage_refs
from ds_zero._params.placement import family_group
from ds_zero._params.storage_pool import released_storages

if TYPE_CHECKING:
    from ds_zero._nvme.grad_swapper import GradSwapper
    from ds_zero._stage3.partition_index import PartitionIndex

logger = logging.getLogger(__name__)

__all__ = ["GradReducer"]


def _buckets(params: list[nn.Parameter], bucket_numel: int) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        full = bool(out) and size + p.ds_numel > bucket_numel
        if not out or full or out[-1][0].dtype != p.dtype or family_group(out[-1][0]) is not family_group(p):
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.ds_numel
    return out


class GradReducer:
    """Buckets, reduce-scatters and accumulates the gradients of partitioned parameters.

    Args:
        params: trainable partitioned parameters, each in `partition_index`.
        partition_index: the optimizer's `PartitionIndex`: per parameter, the flat fp32 master whose `.grad`
            the reduced shard goes to and the shard's offset in it (`grad_flat`, `grad_offset`); each record's
            `grad_bucket` is set here.
        group: the data-parallel group.
        reduce_bucket_size: elements per reduce-scatter (a larger parameter gets a bucket of its own).
        communication_dtype: dtype of the collective (None: the parameters' dtype).
        gradient_predivide_factor: divide by this before the reduction and by world/factor after.
        on_first_grad: called for every arriving gradient (the coordinator's backward start).
        overlap_comm: keep one bucket's reduce-scatter in flight while backward continues (False: wait for
            each as it is issued).
        swapped: for parameters whose tile's gradient is swapped to NVMe, `id(param) -> (tile, offset)`.
        grad_swapper: the `GradSwapper` those pieces go to (flushed at the end of each backward).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        partition_index: PartitionIndex,
        group: ProcessGroup | None,
        reduce_bucket_size: int,
        communication_dtype: torch.dtype | None,
        gradient_predivide_factor: float,
        on_first_grad: Any,
        swapped: Mapping[int, tuple[Any, int]] | None = None,
        grad_swapper: GradSwapper | None = None,
        overlap_comm: bool = True,
    ) -> None:
        self.partition_index = partition_index
        self.group = group
        self.overlap_comm = overlap_comm
        # NVMe: parameter id -> (tile, offset in the tile); their pieces go to `grad_swapper`, not to a master
        self._swapped = dict(swapped or {})
        self.grad_swapper = grad_swapper
        self.world = ds_comm.get_world_size(group)
        self.comm_dtype = communication_dtype
        self.pre = float(gradient_predivide_factor)
        self.post = self.world / self.pre
        self._on_first_grad = on_first_grad
        # One rank reduces nothing: a bucket per parameter lets each gradient go (copy-free) as it arrives.
        self.buckets = _buckets(params, 1 if self.world == 1 and self.pre == 1.0 else max(1, reduce_bucket_size))
        for number, bucket in enumerate(self.buckets):
            for p in bucket:
                partition_index[p].grad_bucket = number
        self._arrived = [0] * len(self.buckets)
        self._seen: set[int] = set()
        self._late: set[int] = set()
        self.saw_late = False  # a bucket ever got a second gradient in one backward (reentrant checkpointing)
        self._next = 0
        self._active = False
        self._fresh: set[int] = set()
        self._inflight: list[tuple[Any, torch.Tensor, list[nn.Parameter], list[int], torch.Tensor]] = []
        #: While set, backwards leave their gradients on the parameters (`reduce_deferred()` reduces them).
        self.deferred = False
        #: Called with each parameter once its reduced shard is in its master's gradient (SuperOffload).
        self.on_piece: Callable[[nn.Parameter], None] | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        # the buckets' send and receive buffers, reused backward after backward (see `_buffer_pool`)
        self._buffers = BufferPool()
        self._pooled: set[int] = set()  # ids of the in-flight buffers taken from the pool
        # dividing by a power of two is exact, so it can ride on the copy into the master gradient
        self._post_is_power_of_two = math.frexp(self.post)[0] == 0.5

    def _on_grad(self, param: nn.Parameter) -> None:
        self._on_first_grad()
        if param.grad is None or self.deferred:  # deferred: it stays on the parameter, later backwards add
            return
        self._active = True
        index = self.partition_index[param].grad_bucket
        assert index is not None
        if index < self._next:  # a second gradient after its bucket went (reentrant checkpointing)
            self._late.add(index)
            return
        if id(param) not in self._seen:
            self._seen.add(id(param))
            self._arrived[index] += 1
        while self._next < len(self.buckets) and self._arrived[self._next] == len(self.buckets[self._next]):
            self._reduce(self.buckets[self._next])
            self._next += 1

    def _group_of(self, params: list[nn.Parameter]) -> tuple[ProcessGroup | None, int]:
        """The bucket's group and its size: the data-parallel group, or the bucket's placement family's
        (AutoEP experts: their expert-data-parallel group; still averaged over the data-parallel world)."""
        family = family_group(params[0])
        if family is None:
            return self.group, self.world
        return family, ds_comm.get_world_size(family)

    def _reduce(self, params: list[nn.Parameter]) -> None:
        group, world = self._group_of(params)
        dtype = self.comm_dtype or params[0].dtype
        sizes = [state_of(p).shard_numel for p in params]
        total = sum(sizes)
        device = state_of(params[0]).full.device
        if world == 1 and len(params) == 1 and self.pre == 1.0:
            grad = params[0].grad
            if grad is not None and grad.dtype == dtype and grad.is_contiguous() and grad.numel() == total:
                # one rank: the reduction is the identity, the gradient itself is the piece (no copies)
                params[0].grad = None
                while self._inflight:
                    self._complete(self._inflight.pop(0))
                self._issued((None, grad.reshape(-1), params, sizes, grad))
                return
        if world == 2 and self.pre == 1.0 and self._reduce_in_pairs(params, sizes, total, dtype, device, group):
            return
        inp = self._take(world * total, dtype, device).view(world, total)
        offset = 0
        with torch.no_grad():
            for p, s in zip(params, sizes, strict=True):
                dest = inp[:, offset : offset + s]
                grad = p.grad
                if grad is None:
                    dest.zero_()
                elif p.ds_numel == world * s:
                    dest.copy_(grad.reshape(world, s))
                else:
                    padded = torch.zeros(world * s, dtype=dtype, device=device)
                    padded[: p.ds_numel].copy_(grad.reshape(-1))
                    dest.copy_(padded.view(world, s))
                p.grad = None
                offset += s
            if self.pre != 1.0:
                inp.div_(self.pre)
        if world == 1:
            out, work = inp.view(-1), None
        else:
            out = self._take(total, dtype, device)
            work = ds_comm.reduce_scatter_tensor(out, inp.view(-1), group=group, async_op=True)
        # one bucket in flight while the next fills: older ones are finished now, freeing their buffers
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self._issued((work, out, params, sizes, inp))

    def _reduce_in_pairs(
        self,
        params: list[nn.Parameter],
        sizes: list[int],
        total: int,
        dtype: torch.dtype,
        device: torch.device,
        group: ProcessGroup | None,
    ) -> bool:
        """Two gloo CPU ranks: each gradient sends the peer its half straight from `.grad` into the peer's
        bucket output, and adds its own half there once received (`ds_comm.pair_exchange`): the same sum
        as the reduce-scatter's (two addends), without staging the bucket's gradients in a send buffer.
        False, nothing issued, when the group or the parameters do not allow it.

        Both ranks must decide alike (one in a pair exchange, the other in a reduce-scatter would hang), so
        the decision reads only what they share: the group, the parameters' dtypes and shard sizes. What may
        differ between them is adapted instead: a gradient this rank never got (an expert no token of this
        rank reached) is sent as zeros, as the reduce-scatter's bucket holds it."""
        if any(p.dtype != dtype or p.ds_numel != 2 * s for p, s in zip(params, sizes, strict=True)):
            return False
        peers = ds_comm.pair_ranks(group)
        if peers is None:
            return False
        me, peer = peers
        grads = [
            torch.zeros(2 * s, dtype=dtype, device=device)
            if p.grad is None
            else p.grad.detach().to(device=device, dtype=dtype).contiguous()
            for p, s in zip(params, sizes, strict=True)
        ]
        out = self._take(total, dtype, device)
        sends, recvs, own = [], [], []
        offset = 0
        for g, s in zip(grads, sizes, strict=True):
            rows = g.view(2, s)
            sends.append(rows[peer])
            own.append(rows[me])
            recvs.append(out[offset : offset + s])
            offset += s
        # the own half is added as the peer's arrives (one pass: `recv = own + peer's`, IEEE's either-order sum)
        work = ds_comm.pair_exchange(sends, recvs, group=group, op="reduce_scatter_tensor", addends=own)
        if work is None:
            self._give(out)
            return False
        for p in params:
            p.grad = None
        while self._inflight:
            self._complete(self._inflight.pop(0))
        self._issued((work, out, params, sizes, out))
        return True

    def _issued(self, item: tuple[Any, torch.Tensor, list[nn.Parameter], list[int], torch.Tensor]) -> None:
        """Leave a just-issued bucket in flight (`overlap_comm`), or finish it now."""
        if self.overlap_comm:
            self._inflight.append(item)
        else:
            self._complete(item)

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.take(numel, dtype, device)
        self._pooled.add(id(buf))
        return buf

    def _give(self, *bufs: torch.Tensor) -> None:
        for buf in bufs:
            base = buf if buf._base is None else buf._base
            if id(base) in self._pooled:
                self._pooled.discard(id(base))
                self._buffers.give(base)

    def _complete(self, item: tuple[Any, torch.Tensor, list[nn.Parameter], list[int], torch.Tensor]) -> None:
        work, out, params, sizes, inp = item
        if work is not None:
            work.wait()
        swapped = any(id(p) in self._swapped for p in params)
        scale = 1.0
        if self.post != 1.0:
            # halving is exact but in fp16's wide subnormal range, where the separate division's rounding stays
            if self._post_is_power_of_two and not swapped and out.dtype != torch.float16:
                scale = 1.0 / self.post  # folded into the copy into the master gradient (one pass less)
            else:
                out.div_(self.post)
        self._add_pieces(out, params, sizes, scale)  # its temporaries go with its frame (`_recycle_gradient`)
        own_gradient = work is None and id(inp) not in self._pooled  # one rank's identity path
        if not swapped:  # the NVMe swapper may still read `out`
            self._give(out, inp)
        if own_gradient:
            _recycle_gradient(inp, out)

    def _add_pieces(self, out: torch.Tensor, params: list[nn.Parameter], sizes: list[int], scale: float = 1.0) -> None:
        """Add each parameter's piece of the reduced `out`, times `scale`, to its master gradient (or its NVMe
        gradient tile: only with scale 1)."""
        offset = 0
        with torch.no_grad():
            for p, s in zip(params, sizes, strict=True):
                route = self._swapped.get(id(p))
                if route is not None and self.grad_swapper is not None:
                    self.grad_swapper.add(route[0], route[1], out[offset : offset + s])
                    offset += s
                    continue
                slots = self.partition_index[p]
                master, moff = slots.grad_flat, slots.grad_offset
                if master.grad is None:
                    # every bucket is reduced once per backward and the shards tile the master, so each
                    # slice is written exactly once before it is read: no need to zero it first
                    master.grad = torch.empty_like(master)
                    self._fresh.add(id(master))
                piece = out[offset : offset + s].to(master.grad.device)
                dest = master.grad[moff : moff + s]
                if id(master) in self._fresh:
                    if scale == 1.0:
                        dest.copy_(piece)
                    else:
                        torch.mul(piece, scale, out=dest)
                else:
                    dest.add_(piece, alpha=scale)
                offset += s
                if self.on_piece is not None:
                    self.on_piece(p)

    def finish(self) -> None:
        """End of backward: issue the remaining buckets in order, wait, add the results into the master grads."""
        if self._active:
            while self._next < len(self.buckets):
                self._reduce(self.buckets[self._next])
                self._next += 1
            late = sorted(self._late)
            self.saw_late = self.saw_late or bool(late)
            if late:  # second gradients of a bucket: they add to the first, whatever the master's state
                for item in self._inflight:
                    self._complete(item)
                self._inflight.clear()
                self._fresh.clear()
            for index in late:
                self._reduce(self.buckets[index])
        self._late.clear()
        self._seen.clear()
        self._arrived = [0] * len(self.buckets)
        self._next = 0
        self._active = False
        inflight, self._inflight = self._inflight, []
        for item in inflight:
            self._complete(item)
        self._fresh.clear()
        if self.grad_swapper is not None:
            self.grad_swapper.flush()

    def reduce_deferred(self) -> None:
        """Reduce the gradients deferred backwards left on the parameters: every bucket, in order, as the
        end of one backward does (a parameter without a gradient contributes zeros)."""
        self._active = True
        self.finish()

    def discard(self) -> None:
        """Finish anything in flight and drop any full gradient still on a parameter (zero_grad)."""
        self.finish()
        for bucket in self.buckets:
            for p in bucket:
                p.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _recycle_gradient(grad: torch.Tensor, piece: torch.Tensor) -> bool:
    """One rank: the parameter's own gradient was the reduced piece and has been added where it goes; its
    memory goes to the released-storage pool for the next gradient of that size (`_construct.linear`'s
    `_weight_grad`), unless a tensor besides `grad` and its view `piece` still holds it (a hook that kept it).
    Whether it went to the pool."""
    holders = (1 if piece is grad else 2) + 1  # + the temporary storage handle `storage_refs` itself takes
    return storage_refs(grad) == holders and released_storages.take_from(grad.untyped_storage())
