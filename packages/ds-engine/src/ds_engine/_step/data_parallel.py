"""Stage-0 data parallelism: flat gradient buffers, bucketed all-reduce at the boundary, the init broadcast.

[Note: flat gradients] At the accumulation boundary each trainable parameter's `.grad` is a view
into one contiguous buffer per dtype: a bucket is a slice of that buffer (all-reduced in place, no
flatten/unflatten copies), and clipping, unscaling and the overflow check are single ops over it.
Between boundaries `.grad` is autograd's own tensor (micro-steps accumulate into it as in plain
torch); `rebind()` copies it into the view once per step, which costs less than zeroing the buffer
and accumulating into it. A `.grad` a script replaced or set to None is handled the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_engine._plan.reduce_settings import ReduceSettings

logger = logging.getLogger(__name__)

__all__ = ["FlatGradBuffer", "GradAllReducer", "broadcast_module_states"]


class FlatGradBuffer:
    """Gradients of `params` as views into one contiguous `dtype` tensor.

    Args:
        params: the parameters, in a fixed order (all on one device).
        dtype: the buffer dtype (the accumulation dtype).
        bind: make each `param.grad` the view. With `lazy_bind` the binding happens at the first
            `rebind()` (the first boundary copies the gradients autograd allocated), so building the
            buffer costs no memset; otherwise the buffer is zeroed and bound now (needed when
            something else accumulates into the views, as fp32 accumulation for 16-bit params does).
        lazy_bind: see `bind`.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], dtype: torch.dtype, *, bind: bool, lazy_bind: bool = False
    ) -> None:
        if not params:
            raise ValueError("FlatGradBuffer needs at least one parameter")
        device = params[0].device
        self.params = list(params)
        self.numels = [p.numel() for p in self.params]
        lazy = bind and lazy_bind
        make = torch.empty if lazy else torch.zeros
        self.flat = make(sum(self.numels), dtype=dtype, device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p, n in zip(self.params, self.numels, strict=True):
            self.views.append(self.flat[offset : offset + n].view(p.shape))
            offset += n
        self._bound = bind
        if bind and not lazy:
            for p, view in zip(self.params, self.views, strict=True):
                p.grad = view

    def views_of(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The views of those of `params` this buffer holds (in buffer order)."""
        wanted = {id(p) for p in params}
        return [view for p, view in zip(self.params, self.views, strict=True) if id(p) in wanted]

    def zero_(self) -> None:
        """Clear the gradients, keeping the views in place (for buffers something accumulates into)."""
        self.flat.zero_()

    def release(self) -> None:
        """Set the bound `.grad`s to None; the next backward's gradients are copied in by `rebind()`.

        Cheaper than `zero_()` for bound buffers: autograd hands over its freshly computed gradient
        (no memset, no in-place add) and the boundary copies it once, as DDP's bucket views do.
        """
        for p in self.params:
            p.grad = None

    def rebind(self) -> None:
        """Point every `.grad` at its view, copying in gradients autograd allocated (zeros where none)."""
        if not self._bound:
            return
        fresh_views, fresh_grads = [], []
        for p, view in zip(self.params, self.views, strict=True):
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                fresh_views.append(view)
                fresh_grads.append(grad)
            p.grad = view
        if fresh_views:
            torch._foreach_copy_(fresh_views, fresh_grads)

    def span(self, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """The slice of the buffer holding parameters `first` .. `stop - 1` (all of them by default)."""
        begin = sum(self.numels[:first])
        end = begin + sum(self.numels[first:stop])
        return self.flat[begin:end]

    def bucket_slices(self, bucket_numel: int, first: int = 0, stop: int | None = None) -> list[torch.Tensor]:
        """Contiguous slices of the buffer of at most `bucket_numel` elements, cut at parameter boundaries,
        over parameters `first` .. `stop - 1` (all of them by default).

        A parameter larger than the bucket gets a slice of its own.
        """
        slices: list[torch.Tensor] = []
        start = end = sum(self.numels[:first])
        for n in self.numels[first:stop]:
            if end > start and end - start + n > bucket_numel:
                slices.append(self.flat[start:end])
                start = end
            end += n
        if end > start:
            slices.append(self.flat[start:end])
        return slices


class GradAllReducer:
    """All-reduces a `FlatGradBuffer` in buckets at the accumulation boundary (DeepSpeed's stage-0 scaling).

    A mean without prescale: multiply by `1/predivide`, all-reduce (sum), then by `predivide/world`. With
    prescale: multiply by `1/world`, all-reduce. A sum (`gradient_allreduce_op: "sum"`) is the all-reduce
    alone: DeepSpeed scales by neither prescale nor predivide then. Every bucket's all-reduce is issued before
    any is waited on, so gloo/nccl pipeline them.
    Collective: one all-reduce per bucket on `group`, in the same order on every rank.

    `first`/`stop` restrict it to the buffer's parameters `first` .. `stop - 1`, so one buffer's parts can
    be reduced over different groups (an MoE model's dense and expert gradients).
    """

    def __init__(
        self,
        buffer: FlatGradBuffer,
        settings: ReduceSettings,
        *,
        group: ProcessGroup | None,
        world_size: int,
        first: int = 0,
        stop: int | None = None,
    ) -> None:
        self.buffer = buffer
        self.group = group
        self.world_size = world_size
        self.region = buffer.span(first, stop)
        self.buckets = buffer.bucket_slices(settings.bucket_numel, first, stop)
        comm = settings.comm_dtype
        self.comm_dtype = comm if comm is not None and comm != buffer.flat.dtype else None
        if not settings.average:
            self.pre, self.post = 1.0, 1.0
        elif settings.prescale:
            self.pre, self.post = 1.0 / world_size, 1.0
        else:
            self.pre, self.post = 1.0 / settings.predivide, settings.predivide / world_size

    def all_reduce(self) -> None:
        flat = self.region
        if self.pre != 1.0:
            flat.mul_(self.pre)
        if self.comm_dtype is None:
            handles = [ds_comm.all_reduce(b, group=self.group, async_op=True) for b in self.buckets]
            for handle in handles:
                handle.wait()
        else:
            staged = [b.to(self.comm_dtype) for b in self.buckets]
            handles = [ds_comm.all_reduce(s, group=self.group, async_op=True) for s in staged]
            for handle, bucket, s in zip(handles, self.buckets, staged, strict=True):
                handle.wait()
                bucket.copy_(s)
        if self.post != 1.0:
            flat.mul_(self.post)


@torch.no_grad()
def broadcast_module_states(
    tensors: Iterable[torch.Tensor], *, src: int, group: ProcessGroup | None, bucket_bytes: int = 250 * 1024 * 1024
) -> None:
    """Make every rank's `tensors` equal to rank `src`'s, in coalesced buckets per dtype.

    Collective: one broadcast per bucket on `group`.
    """
    by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), group_tensors in by_key.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group_tensors:
            bucket.append(t)
            size += t.numel() * itemsize
            if size >= bucket_bytes:
                _broadcast_bucket(bucket, src, group)
                bucket, size = [], 0
        if bucket:
            _broadcast_bucket(bucket, src, group)


def _broadcast_bucket(tensors: list[torch.Tensor], src: int, group: ProcessGroup | None) -> None:
    flat = torch._utils._flatten_dense_tensors([t.data for t in tensors])
    ds_comm.broadcast(flat, src, group=group)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, [t.data for t in tensors]), strict=True):
        t.data.copy_(synced)
