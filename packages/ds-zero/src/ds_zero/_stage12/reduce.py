"""Gradient reduction for ZeRO stages 1 and 2: reducing a flat range to the ranks that own it, and stage 1's
reduction of full gradients at the accumulation boundary.

[Note: reduce to owners] A gradient bucket covers a contiguous range of a group's flat buffer. Each rank
only needs the summed values of its own partition, so the range is cut at partition boundaries and each
piece goes to the rank that owns it: together the pieces form a reduce-scatter of the bucket, whatever its
position. (Buckets that fill during backward lie in one or two partitions; a balanced
`reduce_scatter_tensor` would have to wait for the whole model.) On nccl each piece is a `reduce` to its
owner. On gloo every other rank sends its piece to the owner (`isend`/`irecv`) and the owner adds the
pieces straight into its fp32 partition: in aggregate that moves and adds what a ring reduce-scatter does,
and costs about half of gloo's `reduce` plus the add (measured with 2 ranks on 26 MB buckets: 16-17 ms vs
26-34 ms of process CPU time; gloo's `reduce_scatter_tensor` costs more than its `all_reduce`). Two ranks
make it one `ds_comm.pair_exchange` (shared memory on one host).
`reduce_scatter=False` all-reduces the bucket instead and each rank keeps its piece.

[Note: two ranks sum as they receive] In the pair exchange the owner's own piece is the addend of its
receive (`recv = own + peer's`, one pass over shared memory), and the average is taken once from that sum:
two passes over the owner's piece instead of three (copy the peer's piece out, scale or add the own piece,
add the peer's). This is done for fp32 buckets when the averaging factor is a power of two (2 ranks, no
predivide): then `(own + peer) * f` is exactly `own * f + peer * f`, which the separate passes computed,
and exactly what an all-reduce followed by the division gives (DDP's result). A bf16 or fp16 bucket keeps
the separate passes: its sum would round in the bucket's dtype, where they add into the fp32 partition.
With micro-steps accumulating into an fp32 partition (stage 2), the step's averaged sum is added once, as
DeepSpeed adds its averaged bucket.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._partition import owner_pieces
from ds_zero._stage12.flat_buffer import FlatParamGroup
from ds_zero._stage12.graph_grads import GraphOwnedGrads
from ds_zero._stage12.pair_memory import gradient_memory, reduce_with_peer

logger = logging.getLogger(__name__)

__all__ = ["BoundaryReducer", "RangeReducer"]

_TAG_SPACE = 1 << 20


@dataclass
class _Launched:
    buffer: torch.Tensor
    start: int
    end: int
    handles: list[ds_comm.CollectiveHandle]
    received: list[torch.Tensor] = field(default_factory=list)
    summed: bool = False  # `received` already holds own + peer's (the module's last note)


class RangeReducer:
    """Reduces a buffer holding flat range `[start, end)` of a group so its owners receive the sums.

    Args:
        group: the process group the range's parameters are replicated and partitioned over (None: world).
        use_reduce_scatter: send each piece to its owner (True) or all-reduce the whole range (False).
        predivide_factor: divide before the reduction by this, and by `average_world / predivide_factor`
            after (guards fp16 sums against overflow on large worlds; 1.0 = divide once, after).
        average_world: the number of data-parallel losses the sum is averaged over (None: the group's
            size). Expert parameters are reduced over their expert-data-parallel group but averaged over
            the whole data-parallel world, since tokens of every data-parallel rank reach them.
        average: False keeps the plain sum of the ranks' gradients (`gradient_allreduce_op: "sum"`): no
            division at all, `predivide_factor` included, as DeepSpeed sums.
    """

    def __init__(
        self,
        group: ProcessGroup | None,
        *,
        use_reduce_scatter: bool,
        predivide_factor: float,
        average_world: int | None = None,
        average: bool = True,
    ) -> None:
        self.group = group
        self.world = ds_comm.get_world_size(group)
        self.rank = ds_comm.get_rank(group)
        self.use_reduce_scatter = use_reduce_scatter
        self.predivide_factor = float(predivide_factor) if average else 1.0
        self.post_scale = self.predivide_factor / (average_world or self.world) if average else 1.0
        self._global = [ds_comm.get_global_rank(group, r) for r in range(self.world)]
        backend = dist.get_backend(group) if ds_comm.is_initialized() else "gloo"
        self.point_to_point = use_reduce_scatter and backend == "gloo"
        # the last note of the module: the pair exchange sums where the average is then exact
        self._sum_in_exchange = math.frexp(self.post_scale)[0] == 0.5
        self._pool: list[torch.Tensor] = []
        self._tag = 0

    @property
    def sums_pairs_in_place(self) -> bool:
        """Whether fp32 buffers in pair memory may be reduced by `pair_memory.reduce_with_peer`: two gloo
        ranks reducing to owners, a power-of-two average and no predivision (the module's last note)."""
        return self.point_to_point and self.world == 2 and self._sum_in_exchange and self.predivide_factor == 1.0

    def launch(self, buffer: torch.Tensor, start: int, end: int, partition_numel: int) -> _Launched:
        """Start the reduction of `buffer` (= flat range `[start, end)`); all communication is asynchronous."""
        if self.predivide_factor != 1.0:
            buffer.mul_(1.0 / self.predivide_factor)
        launched = _Launched(buffer, start, end, [])
        if self.world == 1:
            return launched
        if not self.use_reduce_scatter:
            launched.handles.append(ds_comm.all_reduce(buffer, group=self.group, async_op=True))
            return launched
        if self.point_to_point and self.world == 2 and self._launch_pair(launched, partition_numel):
            return launched
        self._tag = (self._tag + 1) % _TAG_SPACE
        for owner, lo, hi in owner_pieces(start, end, partition_numel):
            piece = buffer[lo - start : hi - start]
            if not self.point_to_point:
                launched.handles.append(ds_comm.reduce(piece, dst=self._global[owner], group=self.group, async_op=True))
            elif owner != self.rank:
                launched.handles.append(ds_comm.isend(piece, self._global[owner], group=self.group, tag=self._tag))
            else:
                for src in range(self.world):
                    if src != self.rank:
                        recv = self._acquire(piece)
                        launched.received.append(recv)
                        launched.handles.append(ds_comm.irecv(recv, self._global[src], group=self.group, tag=self._tag))
        return launched

    def _launch_pair(self, launched: _Launched, partition_numel: int) -> bool:
        """Two gloo ranks: the piece the peer owns goes out and the peer's copy of this rank's piece comes
        in as one pair exchange (`ds_comm.pair_exchange`; through shared memory where both ranks share a
        host, see ds_comm). False, nothing issued, where the group or the buffer do not allow it: both ranks
        decide alike, from the group and the bucket's range, which they share."""
        sends, recvs, own = [], [], []
        for owner, lo, hi in owner_pieces(launched.start, launched.end, partition_numel):
            piece = launched.buffer[lo - launched.start : hi - launched.start]
            if owner != self.rank:
                sends.append(piece)
            else:
                recvs.append(self._acquire(piece))
                own.append(piece)
        # an fp32 sum only: a bf16/fp16 bucket's own + peer's would round in that dtype, where the separate
        # additions round once, in the fp32 partition they accumulate into
        fp32 = launched.buffer.dtype == torch.float32
        addends = own if self._sum_in_exchange and own and fp32 else None
        handle = ds_comm.pair_exchange(sends, recvs, group=self.group, op="reduce", addends=addends)
        if handle is None:
            for recv in recvs:
                self._release(recv)
            return False
        launched.received.extend(recvs)
        launched.handles.append(handle)
        launched.summed = addends is not None
        return True

    def own_piece(self, launched: _Launched, partition_numel: int) -> tuple[slice, slice] | None:
        """`(slice of the buffer, slice of this rank's partition)` for the part of the range it owns."""
        lo = max(launched.start, self.rank * partition_numel)
        hi = min(launched.end, (self.rank + 1) * partition_numel)
        if lo >= hi:
            return None
        p0 = self.rank * partition_numel
        return slice(lo - launched.start, hi - launched.start), slice(lo - p0, hi - p0)

    def complete(
        self, launched: _Launched, accumulator: torch.Tensor, partition_numel: int, *, in_place: bool = False
    ) -> None:
        """Wait for `launched` and add this rank's averaged piece into its partition `accumulator`.

        `in_place`: the accumulator already holds this rank's own contribution (stage 1, fp32), which
        is scaled rather than added.
        """
        for h in launched.handles:
            h.wait()
        piece = self.own_piece(launched, partition_numel)
        if piece is not None and launched.summed:  # own + peer's already, in the one received piece
            (total,) = launched.received
            acc = accumulator[piece[1]]
            if in_place:
                torch.mul(_to(total, acc.device), self.post_scale, out=acc)
            else:
                acc.add_(_to(total, acc.device), alpha=self.post_scale)
        elif piece is not None:
            src, dst = piece
            acc = accumulator[dst]
            if in_place:
                acc.mul_(self.post_scale)
            else:
                acc.add_(_to(launched.buffer[src], acc.device), alpha=self.post_scale)
            for recv in launched.received:
                acc.add_(_to(recv, acc.device), alpha=self.post_scale)
        for recv in launched.received:
            self._release(recv)
        launched.received.clear()

    def _acquire(self, like: torch.Tensor) -> torch.Tensor:
        for i, buf in enumerate(self._pool):
            if buf.numel() >= like.numel() and buf.dtype == like.dtype and buf.device == like.device:
                return self._pool.pop(i)[: like.numel()]
        return torch.empty(like.numel(), dtype=like.dtype, device=like.device)

    def _release(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        self._pool.append(base)

    def buffers(self) -> list[torch.Tensor]:
        """Receive buffers kept for reuse (for memory accounting)."""
        return list(self._pool)


def _distinct(reducers: list[RangeReducer]) -> list[RangeReducer]:
    """Each reducer once (flat groups over the same process group share one)."""
    return list({id(r): r for r in reducers}.values())


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)  # blocking: the host reads it right away


class BoundaryReducer(GraphOwnedGrads):
    """Stage 1: full gradients accumulate in a flat buffer per group; `finish()` reduces them to the owners.

    Each parameter's `.grad` is a view into the group's flat gradient buffer, so autograd accumulates
    micro-steps in place and the reduction needs no gathering copy. A `.grad` that is not our view (the
    caller set `.grad = None` or assigned a tensor) is copied in first.

    Args:
        flats: the flat parameter groups.
        reducers: the range reducer of each flat group (groups may reduce over different process groups).
        bucket_numel: elements reduced per collective (`reduce_bucket_size`).
        communication_dtype: dtype of the reduction (None: the model dtype).
        accumulators: per group, this rank's fp32 gradient partition that receives the averaged sums.
            None (model dtype = master dtype, no offload, reduction in that dtype): the own partition of each
            flat gradient buffer is the accumulator, reduced in place, so no second partition-sized buffer exists.
        share: per group, the collective giving pair memory (`pair_memory.share_for`); an fp32 flat gradient
            buffer reduced in place on two ranks of one host lives there and is reduced from the peer's.
    """

    def __init__(
        self,
        flats: list[FlatParamGroup],
        reducers: list[RangeReducer],
        *,
        bucket_numel: int,
        communication_dtype: torch.dtype | None,
        accumulators: list[torch.Tensor] | None,
        share: list[Callable[[int, torch.dtype], ds_comm.PairSharedTensor | None] | None] | None = None,
    ) -> None:
        self.flats = flats
        self.reducers = reducers
        self.bucket_numel = int(bucket_numel)
        self.communication_dtype = communication_dtype
        self.in_place = accumulators is None
        # Two ranks of one host reduce fp32 gradients in place from each other's buffers (pair_memory).
        in_place_fp32 = self.in_place and communication_dtype in (None, torch.float32)
        self.shared: list[ds_comm.PairSharedTensor | None] = [
            gradient_memory(make, f, in_place_fp32 and reducer.sums_pairs_in_place)
            for f, reducer, make in zip(flats, reducers, share or [None] * len(flats), strict=True)
        ]
        self.flat_grads = [
            s.mine if s is not None else torch.zeros(f.padded_numel, dtype=f.dtype, device=f.device)
            for f, s in zip(flats, self.shared, strict=True)
        ]
        if self.in_place:
            # the flat gradients are the accumulators (fp32, or bf16 with bf16 masters): reduced as they are
            assert len({f.dtype for f in flats}) <= 1
            assert communication_dtype is None or all(f.dtype == communication_dtype for f in flats)
            accumulators = [f.own_slice(g) for f, g in zip(flats, self.flat_grads, strict=True)]
        self.accumulators: list[torch.Tensor] = accumulators
        self._clean = True
        self._reduced = False
        # Autograd accumulates into the views in place, invisibly; a hook per parameter only notes that
        # a backward happened, so zero() can skip the memset when nothing was written since the last one.
        self._hooks = [p.register_post_accumulate_grad_hook(self._mark_dirty) for f in flats for p in f.params]
        self.attach()

    def _mark_dirty(self, _param: torch.Tensor) -> None:
        self._clean = False

    def accept_graph_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """`param`'s gradient of this backward, handed over by a compiled backward graph in place of autograd
        (`ds_zero::reduce_grad`): added into `.grad` (its view of the flat buffer) as autograd's accumulation
        would, so `finish()` reduces it at the boundary like every other gradient."""
        self._clean = False
        with torch.no_grad():
            if param.grad is None:
                param.grad = grad.detach().clone()  # `_collect` copies a foreign `.grad` in, as after autograd
            else:
                param.grad.add_(grad)

    @property
    def has_gradients(self) -> bool:
        """Whether a backward wrote gradients since the last `zero()`."""
        return not self._clean

    @property
    def reduced(self) -> bool:
        """Whether `finish()` already reduced this accumulation window (until the next `zero()`)."""
        return self._reduced

    def attach(self) -> None:
        """Point every parameter's `.grad` at its view of the flat gradient buffer."""
        for flat, grads in zip(self.flats, self.flat_grads, strict=True):
            for p, slot in zip(flat.params, flat.slots, strict=True):
                p.grad = flat.slot_view(grads, slot)

    def _collect(self, flat: FlatParamGroup, grads: torch.Tensor) -> None:
        for p, slot in zip(flat.params, flat.slots, strict=True):
            view = flat.slot_view(grads, slot)
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
                view.copy_(g)
            p.grad = None

    def finish(self) -> None:
        """Reduce every group's full gradients into the accumulators (blocking; at most 2 buckets in flight).

        Once per accumulation window: a second call before `zero()` does nothing (the sums are averaged in
        place, and the gradients were taken off the parameters).
        """
        if self._reduced:
            return
        self._reduced = True
        self._clean = False
        for index, (flat, grads) in enumerate(zip(self.flats, self.flat_grads, strict=True)):
            reducer = self.reducers[index]
            self._collect(flat, grads)
            shared = self.shared[index]
            if shared is not None:
                reduce_with_peer(flat, shared, grads, reducer.post_scale)
                continue
            in_flight: list = []
            for start in range(0, flat.numel, self.bucket_numel):
                end = min(start + self.bucket_numel, flat.numel)
                buffer = grads[start:end]
                if self.communication_dtype is not None and self.communication_dtype != buffer.dtype:
                    buffer = buffer.to(self.communication_dtype)
                in_flight.append(reducer.launch(buffer, start, end, flat.partition_numel))
                if len(in_flight) > 2:
                    reducer.complete(
                        in_flight.pop(0), self.accumulators[index], flat.partition_numel, in_place=self.in_place
                    )
            for item in in_flight:
                reducer.complete(item, self.accumulators[index], flat.partition_numel, in_place=self.in_place)

    #: Stage 1 reduces only in `finish()`, so a backward never reduces: deferring changes nothing.
    deferred = False

    def reduce_deferred(self) -> None:
        """Reduce what the backwards since the last `zero()` accumulated (`finish()`; then no more backward)."""
        self.finish()

    def zero(self) -> None:
        """Clear the flat gradient buffers and re-attach the `.grad` views."""
        self._reduced = False
        if not self._clean:
            for grads in self.flat_grads:
                grads.zero_()
            self._clean = True
        self.attach()

    def gradient_tensors(self) -> list[torch.Tensor]:
        """The gradient storage this reducer holds (for memory accounting)."""
        return list(self.flat_grads) + [b for r in _distinct(self.reducers) for b in r.buffers()]

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
