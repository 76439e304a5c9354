"""Stage 2: gradients reduced during backward, bucket by bucket, from per-parameter hooks.

[Note: buckets and order] Buckets are fixed at construction: parameters in reverse registration order
(roughly the order backward produces their gradients), packed while a bucket stays within
`reduce_bucket_size` elements and one param group, so each bucket is a contiguous range of one flat
buffer. A `register_post_accumulate_grad_hook` hook copies a finished gradient into its bucket's staging
buffer and drops `param.grad` at once (full gradients never outlive their bucket). Buckets are launched
strictly in index order, the same on every rank, so collectives match even if hooks fire in a different
order. At the end of each backward (an autograd engine callback) buckets whose parameters got no gradient
are zero-filled and launched, and every reduction is completed into this rank's fp32 partition, so
micro-steps accumulate there. On the two ranks of one host, a bucket of an fp32 group is staged at its
place in a flat buffer in pair memory, and its owner sums the piece out of both ranks' buffers
(ds_zero._stage12.pair_memory).

[Note: clearing by overwriting] A group in pair memory is not cleared by `zero_grad()`: `clear()` marks
its partition logically zero, and the first completion of each bucket after that writes its sum over
the partition instead of adding it (one memset of the partition per step saved, and one read of it).
Whatever no completion wrote by the time the reductions finish (`finish()`: the end of a backward, or a
step without one) is zeroed then, so every reader of the partitions, which all come after `finish()`,
sees what a cleared partition would hold.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import ds_comm
from ds_zero._partition import ParamSlot
from ds_zero._stage12.flat_buffer import FlatParamGroup
from ds_zero._stage12.graph_grads import GraphOwnedGrads
from ds_zero._stage12.pair_memory import pair_buckets
from ds_zero._stage12.reduce import RangeReducer, _distinct, _Launched

logger = logging.getLogger(__name__)

__all__ = ["BucketReducer"]


@dataclass
class _Bucket:
    index: int
    group: int
    start: int
    end: int
    params: list[torch.nn.Parameter]
    slots: list[ParamSlot]
    filled: list[bool] = field(default_factory=list)
    pending: int = 0
    storage: torch.Tensor | None = None
    last_seq: int = 0  # in pair memory: this bucket's number among its group's launches, the last time
    #: In pair memory: this rank's part of each taken gradient, `pos -> (flat index, values)`.
    own: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    written: bool = False  # in pair memory: completed into the partition since the group's last clear()

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def buffer(self) -> torch.Tensor:
        assert self.storage is not None
        return self.storage[: self.numel]

    def reset(self) -> None:
        self.filled = [False] * len(self.params)
        self.pending = len(self.params)
        self.storage = None
        self.own = {}


def _build_buckets(flats: list[FlatParamGroup], bucket_numel: int) -> list[_Bucket]:
    buckets: list[_Bucket] = []
    for g in reversed(range(len(flats))):
        flat = flats[g]
        current: list[int] = []
        size = 0
        for i in reversed(range(len(flat.slots))):
            n = flat.slots[i].numel
            if current and size + n > bucket_numel:
                buckets.append(_make_bucket(len(buckets), g, flat, current))
                current, size = [], 0
            current.append(i)
            size += n
        if current:
            buckets.append(_make_bucket(len(buckets), g, flat, current))
    return buckets


def _make_bucket(index: int, group: int, flat: FlatParamGroup, positions: list[int]) -> _Bucket:
    slots = [flat.slots[i] for i in positions]
    bucket = _Bucket(
        index,
        group,
        min(s.flat_offset for s in slots),
        max(s.flat_end for s in slots),
        [flat.params[i] for i in positions],
        slots,
    )
    bucket.reset()
    return bucket


def _graph_task_id() -> int:
    """An id of the running backward pass (-1 outside one); 0 where torch does not expose it."""
    getter = getattr(torch._C, "_current_graph_task_id", None)
    return getter() if getter is not None else 0


class BucketReducer(GraphOwnedGrads):
    """Reduce-scatters gradients during backward into each rank's fp32 partition (stage 2).

    Args:
        flats: the flat parameter groups.
        reducers: each flat group's range reducer (which process group and collective, predivide factor).
        accumulators: per group, this rank's fp32 gradient partition (accumulates across micro-steps).
        bucket_numel: `reduce_bucket_size` in elements (a larger parameter gets a bucket of its own).
        overlap_comm: launch reductions asynchronously while backward continues (up to `max_in_flight`
            buckets in flight); otherwise each bucket is reduced before backward goes on.
        communication_dtype: dtype of the staging buffers and the reduction (None: the model dtype).
        ignore_unused_parameters: treat parameters without a gradient as zero; else raise at the end of
            backward naming them.
        share: per group, the collective giving pair memory (`pair_memory.share_for`): on two ranks of one
            host an fp32 group stages its buckets in a flat buffer there, read by the peer in place.
    """

    def __init__(
        self,
        flats: list[FlatParamGroup],
        reducers: list[RangeReducer],
        accumulators: list[torch.Tensor],
        *,
        bucket_numel: int,
        overlap_comm: bool,
        communication_dtype: torch.dtype | None,
        ignore_unused_parameters: bool,
        max_in_flight: int = 2,
        share: list[Callable[[int, torch.dtype], ds_comm.PairSharedTensor | None] | None] | None = None,
    ) -> None:
        self.flats = flats
        self.reducers = reducers
        self.accumulators = accumulators
        self.overlap_comm = overlap_comm
        self.ignore_unused_parameters = ignore_unused_parameters
        self.max_in_flight = max(1, max_in_flight) if overlap_comm else 1
        self.buckets = _build_buckets(flats, int(bucket_numel))
        dtype = communication_dtype or (flats[0].dtype if flats else torch.float32)
        self._buffer_numel = max((b.numel for b in self.buckets), default=0)
        self._buffer_dtype = dtype
        self._device = flats[0].device if flats else torch.device("cpu")
        self.pairs = [
            pair_buckets(make, f, reducer.sums_pairs_in_place and dtype == torch.float32)
            for f, reducer, make in zip(flats, reducers, share or [None] * len(flats), strict=True)
        ]
        #: Per group: the partition is logically zero, not yet written over ([Note: clearing by overwriting]).
        self._clear_pending = [False] * len(flats)
        self._pool: list[torch.Tensor] = []
        self._num_buffers = 0
        self._in_flight: deque[tuple[_Bucket, _Launched | None]] = deque()
        self._next = 0
        self._armed: int | None = None
        self._dirty = False
        #: While set, backwards leave their gradients on the parameters (`reduce_deferred()` reduces them).
        self.deferred = False
        self._hooks = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        for bucket in self.buckets:
            for pos, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, pos)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket, pos)))

    def _hook(self, bucket: _Bucket, pos: int):  # noqa: ANN202 - a closure per parameter
        def on_grad(param: torch.Tensor) -> None:
            self._on_grad(bucket, pos, param)

        return on_grad

    def _on_grad(self, bucket: _Bucket, pos: int, param: torch.Tensor) -> None:
        if self.deferred:  # the gradient stays on the parameter; later backwards add to it
            return
        if self._hook_defers_to_graph(param):  # the compiled backward handed it over already
            return
        self._arm()
        self._take(bucket, pos, param)

    def accept_graph_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """`param`'s gradient of this backward, handed over by a compiled backward graph in place of the hook
        (`ds_zero::reduce_grad`): taken into its bucket as the hook takes `.grad`, or, while deferred, added to
        `.grad` as autograd would have."""
        bucket, pos = self._where[id(param)]
        if self.deferred:
            with torch.no_grad():
                if param.grad is None:
                    param.grad = grad.detach().clone()
                else:
                    param.grad.add_(grad)
            return
        self._arm()
        self._take_grad(bucket, pos, grad, keep=False)  # the graph may reuse its memory: copied

    def _arm(self) -> None:
        task = _graph_task_id()
        if self._armed != task:
            # First gradient of this backward pass (a pass that raised never ran its callback, so the
            # graph-task id, not a flag, tells a new pass apart).
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._armed = task

    def _take(self, bucket: _Bucket, pos: int, param: torch.Tensor) -> None:
        """Copy `param`'s gradient into its bucket, drop it, and launch the buckets that are now complete."""
        if param.grad is None:
            return
        grad = param.grad
        param.grad = None
        self._take_grad(bucket, pos, grad, keep=True)

    def _take_grad(self, bucket: _Bucket, pos: int, grad: torch.Tensor, *, keep: bool) -> None:
        """Stage `grad` in its bucket; in pair memory this rank's own part is kept (`keep`: nothing else
        writes `grad`) or staged and read from there, never sent (pair_memory's [Note: the own piece is never
        staged])."""
        self._dirty = True
        if self._in_flight:
            self._complete_launched_pairs()
        if bucket.storage is None:
            bucket.storage = self._storage(bucket)
        slot = bucket.slots[pos]
        values, staging, start = grad.detach().reshape(-1), bucket.buffer, bucket.start
        lo, hi = slot.flat_offset, slot.flat_end
        pair, flat = self.pairs[bucket.group], self.flats[bucket.group]
        # this rank's own part [a, b) of the slot: empty outside pair memory (everything is staged)
        a, b = (hi, hi) if pair is None else (max(lo, flat.own_start), min(hi, flat.own_start + flat.partition_numel))
        if a >= b:
            staging[lo - start : hi - start].copy_(values)
        else:
            if lo < a:
                staging[lo - start : a - start].copy_(values[: a - lo])
            if b < hi:
                staging[b - start : hi - start].copy_(values[b - lo :])
            own = values[a - lo : b - lo]
            if not (keep and pair is not None and own.dtype == pair.dtype):
                own = staging[a - start : b - start].copy_(own)
            bucket.own[pos] = (a, own)
        if not bucket.filled[pos]:
            bucket.filled[pos] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _storage(self, bucket: _Bucket) -> torch.Tensor:
        pair = self.pairs[bucket.group]
        return pair.stage(bucket.start, bucket.end, bucket.last_seq) if pair is not None else self._acquire()

    def _acquire(self) -> torch.Tensor:
        if not self._pool and self._in_flight and self._num_buffers >= self.max_in_flight:
            self._complete_oldest()
        if self._pool:
            return self._pool.pop()
        self._num_buffers += 1
        return torch.empty(self._buffer_numel, dtype=self._buffer_dtype, device=self._device)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            self._next += 1
            flat = self.flats[bucket.group]
            pair = self.pairs[bucket.group]
            launched: _Launched | None = None
            if pair is not None:  # the peer sums its piece straight out of this rank's staging (pair_memory)
                bucket.last_seq = pair.launch()
            else:
                launched = self.reducers[bucket.group].launch(
                    bucket.buffer, bucket.start, bucket.end, flat.partition_numel
                )
            self._in_flight.append((bucket, launched))
            if not self.overlap_comm:
                self._complete_oldest()

    def _complete_launched_pairs(self) -> None:
        """Complete, oldest first, the pair-memory buckets the peer has launched too (checked as each gradient
        arrives): no wait, and the gradients they keep (pair_memory's [Note: the own piece is never staged]) go
        early."""
        while self._in_flight:
            bucket, launched = self._in_flight[0]
            pair = self.pairs[bucket.group]
            if launched is not None or pair is None or not pair.launched_by_peer(bucket.last_seq):
                return
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        bucket, launched = self._in_flight.popleft()
        flat = self.flats[bucket.group]
        pair = self.pairs[bucket.group]
        if launched is None:
            assert pair is not None
            scale = self.reducers[bucket.group].post_scale
            overwrite = self._clear_pending[bucket.group] and not bucket.written
            own = list(bucket.own.values())
            pair.complete(flat, bucket.last_seq, own, self.accumulators[bucket.group], scale, overwrite=overwrite)
            bucket.written = True
            bucket.own = {}
        else:
            self.reducers[bucket.group].complete(launched, self.accumulators[bucket.group], flat.partition_numel)
            assert bucket.storage is not None
            self._pool.append(bucket.storage)
        bucket.storage = None

    def _end_of_backward(self) -> None:
        """Zero-fill and launch buckets whose parameters got no gradient, then finish every reduction."""
        self._armed = None
        missing: list[str] = []
        for bucket in self.buckets[self._next :]:
            if bucket.pending == 0:
                continue
            if bucket.storage is None:
                bucket.storage = self._storage(bucket)
            for pos, slot in enumerate(bucket.slots):
                if not bucket.filled[pos]:
                    zeros = torch.zeros(slot.numel, dtype=self._buffer_dtype, device=self._device)
                    self._take_grad(bucket, pos, zeros, keep=False)
                    missing.append(slot.name)
            bucket.pending = 0
        self._launch_ready()
        self.finish()
        self._next = 0
        for bucket in self.buckets:
            bucket.reset()
        if missing and not self.ignore_unused_parameters:
            raise ds_comm.UsageError(
                f"parameters {missing[:10]} received no gradient in this backward; set "
                "zero_optimization.ignore_unused_parameters=true to treat them as zero, or freeze "
                "them (requires_grad=False) before building the optimizer"
            )

    def reduce_deferred(self) -> None:
        """Reduce the gradients deferred backwards left on the parameters, as one backward would have.

        Every bucket goes in index order (a parameter without a gradient counts as missing, as at the end
        of a backward), and every reduction is completed into the accumulators.
        """
        for bucket in self.buckets:
            for pos, param in enumerate(bucket.params):
                self._take(bucket, pos, param)
        self._end_of_backward()

    def finish(self) -> None:
        """Complete every launched reduction; afterwards the accumulators hold all reduced gradients."""
        while self._in_flight:
            self._complete_oldest()
        self._settle_clears()

    def clear(self, group: int) -> bool:
        """Mark `group`'s partition logically zero if it is in pair memory ([Note: clearing by overwriting]);
        False: it is not, and the caller zeroes it."""
        if self.pairs[group] is None:
            return False
        self._clear_pending[group] = True
        for bucket in self.buckets:
            if bucket.group == group:
                bucket.written = False
        return True

    def _settle_clears(self) -> None:
        """Zero what no completion wrote over since a `clear()` (the buckets not reduced; nothing writes the
        padding, which stays zero)."""
        for g, pending in enumerate(self._clear_pending):
            if not pending:
                continue
            flat, acc = self.flats[g], self.accumulators[g]
            lo, hi = flat.own_start, flat.own_start + flat.partition_numel
            for bucket in self.buckets:
                if bucket.group == g and not bucket.written and max(lo, bucket.start) < min(hi, bucket.end):
                    acc[max(lo, bucket.start) - lo : min(hi, bucket.end) - lo].zero_()
            self._clear_pending[g] = False

    def zero(self) -> None:
        """Drop any gradients left on parameters and reset per-backward state (accumulators are the caller's)."""
        while self._in_flight:
            self._complete_oldest()
        for bucket in self.buckets:
            if bucket.storage is not None and self.pairs[bucket.group] is None:
                self._pool.append(bucket.storage)
            bucket.reset()
            for p in bucket.params:
                p.grad = None
        self._next = 0
        self._armed = None
        self._dirty = False

    @property
    def has_gradients(self) -> bool:
        """Whether a backward reduced gradients into the accumulators since the last `zero()`."""
        return self._dirty

    def gradient_tensors(self) -> list[torch.Tensor]:
        """Staging and receive buffers held (for memory accounting; accumulators are counted by the caller)."""
        staged = [p.shared.mine for p in self.pairs if p is not None]
        return list(self._pool) + staged + [b for r in _distinct(self.reducers) for b in r.buffers()]

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
