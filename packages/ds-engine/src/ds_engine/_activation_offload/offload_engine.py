"""Moves activation tensors to reusable host buffers and back, optionally on a side stream.

[Note: lifecycle of one tensor]
`offload_input` gives the tensor an id and parks it among the newest `keep_last_count`
ones, which stay on the device: the first layers backward reaches need them before a
device-to-host copy could finish. When a newer one pushes it out, its copy into a dense
host buffer starts (on the side stream when streams are used; the source stays referenced
in a short "forward stash" so the allocator cannot hand its memory out before the copy
ran). `restore_input` returns, in order of preference: the kept tensor itself, the stashed
source once its copy event passed, or a fresh device tensor with the source's size and
strides filled from the host buffer. Host buffers go back to a pool keyed by
(size, dtype, layout, pinned) once the copy that reads them is known to be done.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ds_comm import Accelerator, get_accelerator

__all__ = ["CheckpointActivationOffloadStats", "OffloadedTensorRef", "ActivationOffloadEngine"]

_BufferKey = tuple[tuple[int, ...], torch.dtype, torch.layout, bool]


@dataclass
class CheckpointActivationOffloadStats:
    """Counters of one offload context (reset on each entry)."""

    saved_tensors_seen: int = 0
    """Tensors autograd asked the pack hook to save."""
    marked_tensors: int = 0
    """`mark()` calls (checkpointed-layer inputs)."""
    offloaded_tensors: int = 0
    """Copies to host started."""
    restored_tensors: int = 0
    """Offloaded tensors handed back for backward."""
    skipped_marked_tensors: int = 0
    """Marked tensors left where they were (host tensor, too small, parameter, overlapping view...)."""
    kept_last_tensors: int = 0
    """Tensors handed back that never left the device (the newest `keep_last_count`)."""
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class OffloadedTensorRef:
    """What autograd holds in place of an offloaded tensor."""

    tensor_id: int


class _HostCopy(NamedTuple):
    """A tensor's data in a dense host buffer, and what is needed to rebuild it on its device.

    A tuple, buffer first, as DeepSpeed's tracker entries are (its tests index them).
    """

    buffer: torch.Tensor
    device: torch.device
    size: torch.Size
    stride: tuple[int, ...]
    key: _BufferKey


def _num_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * tensor.nelement()


def _elements_overlap(tensor: torch.Tensor) -> bool:
    """Whether two indices of `tensor` may address the same element.

    Restoring rebuilds the tensor with its own strides and `copy_` into an aliased layout is
    undefined, so anything not provably free of overlap is treated as overlapping.
    """
    # Sufficient test: by increasing stride, each stride passes the furthest offset the
    # smaller dimensions reach.
    dims = sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.size(), strict=True) if sz > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


class ActivationOffloadEngine:
    """Host offload of activation tensors with buffer reuse and a keep-on-device window.

    Args:
        use_pin_memory: allocate host buffers page-locked (through the accelerator's
            `pin_memory`, so its accounting sees them). Default True.
        use_streams: copy on a side stream and synchronise through events; without it copies
            run on the compute stream. Ignored where the accelerator has no streams.
        min_offload_bytes: tensors smaller than this stay where they are. Default 1024.
        max_fwd_stash_count: how many recently offloaded sources (by id distance) stay
            referenced while their side-stream copy may be running. Default 2.
        max_cpu_buffer_pool_count: host buffers kept for reuse across all shapes. Default 64.
        keep_last_count: the newest tensors that never leave the device. Default 1.
        accelerator: the device the activations live on; `get_accelerator()` when None.

    Raises:
        ValueError: a count or size is negative (the message names the argument).
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2,
        max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1,
        *,
        accelerator: Accelerator | None = None,
    ) -> None:
        for name, value in (
            ("keep_last_count", keep_last_count),
            ("max_fwd_stash_count", max_fwd_stash_count),
            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
            ("min_offload_bytes", min_offload_bytes),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self._accelerator = accelerator if accelerator is not None else get_accelerator()
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0
        self._keep_last: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._tracker: dict[int, _HostCopy] = {}
        self._fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}
        self._restored: dict[int, torch.Tensor] = {}
        self._cpu_buffer_pool: dict[_BufferKey, list[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        # Host buffers a running host-to-device copy still reads, with the event that ends it.
        self._pending_cpu_buffers: list[tuple[_BufferKey, torch.Tensor, Any]] = []
        stream_cls = self._accelerator.Stream
        self.s1: Any = stream_cls() if use_streams and stream_cls is not None else None
        self.use_streams = self.s1 is not None

    # -- streams -------------------------------------------------------------------------------
    @property
    def compute_stream(self) -> Any:
        """The stream compute runs on now (looked up per use: callers may switch streams)."""
        return self._accelerator.current_stream()

    def _copy_stream(self) -> Any:
        return self.s1 if self.use_streams else self.compute_stream

    def _on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if stream is None else self._accelerator.stream(stream)

    @staticmethod
    def _keep_alive_for(tensor: torch.Tensor, stream: Any) -> None:
        # Tells a caching device allocator the memory is in use on `stream`; host memory is
        # freed by reference count alone and has no such allocator.
        if not tensor.is_cpu:
            tensor.record_stream(stream)

    # -- host buffers --------------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> _BufferKey:
        # Host buffers are dense, so sources that differ only in strides share them.
        return (tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory)

    def _pool_cpu_buffer(self, key: _BufferKey, buffer: torch.Tensor) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buffer)
            self._cpu_buffer_pool_count += 1

    def _reap_cpu_buffer_pool(self, *, wait: bool = False) -> None:
        still_pending = []
        for key, buffer, event in self._pending_cpu_buffers:
            if wait:
                event.synchronize()
            if wait or event.query():
                self._pool_cpu_buffer(key, buffer)
            else:
                still_pending.append((key, buffer, event))
        self._pending_cpu_buffers = still_pending

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _BufferKey]:
        """A dense host buffer for `tensor`'s data (pooled when one fits), and its pool key."""
        self._reap_cpu_buffer_pool()
        key = self._buffer_key(tensor)
        pooled = self._cpu_buffer_pool.get(key)
        if pooled:
            self._cpu_buffer_pool_count -= 1
            return pooled.pop(), key
        buffer = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            buffer = self._accelerator.pin_memory(buffer)
        return buffer, key

    # -- offload -------------------------------------------------------------------------------
    def _should_skip(self, tensor: torch.Tensor) -> bool:
        buffer_cls = getattr(torch.nn, "Buffer", None)
        return (
            self._accelerator.is_synchronized_device()
            or not self._accelerator.on_accelerator(tensor)
            or _num_bytes(tensor) < self.min_offload_bytes
            or isinstance(tensor, torch.nn.Parameter)
            or (buffer_cls is not None and isinstance(tensor, buffer_cls))
            or _elements_overlap(tensor)
        )

    def _drop_stashed_sources(self, newest_id: int) -> None:
        # Sources far enough behind the newest id are released; the allocator still holds their
        # memory until the side stream passes their copy (see `_keep_alive_for`).
        for tensor_id in [i for i in self._fwd_stash if i <= newest_id - self.max_fwd_stash_count]:
            del self._fwd_stash[tensor_id]

    def _start_offload(self, tensor_id: int, tensor: torch.Tensor, newest_id: int) -> None:
        if self.use_streams:
            self._drop_stashed_sources(newest_id)
            self.s1.wait_stream(self.compute_stream)  # the copy must see the finished activation
        with self._on(self._copy_stream()):
            buffer, key = self._empty_cpu_like(tensor)
            buffer.copy_(tensor.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = _HostCopy(buffer, tensor.device, tensor.size(), tensor.stride(), key)
        if self.use_streams:
            self._keep_alive_for(tensor, self.s1)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (tensor, self.s1.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _num_bytes(buffer)

    def offload_input(self, tensor: torch.Tensor) -> int | None:
        """Take `tensor` into the engine's care; its id for `restore_input`, or None when skipped.

        Skipped: tensors on a synchronized device or not on the accelerator, smaller than
        `min_offload_bytes`, parameters and buffers, views whose elements may overlap. The
        newest `keep_last_count` tensors stay on the device; older ones start their copy to host.
        """
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        tensor_id = self._next_id
        self._keep_last[tensor_id] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest_id, oldest = self._keep_last.popitem(last=False)
            self._start_offload(oldest_id, oldest, newest_id=tensor_id)
        return tensor_id

    # -- restore -------------------------------------------------------------------------------
    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor `offload_input` returned `tensor_id` for, on its device; consumes the id."""
        return self._restore_tensor(tensor_id, cache=False)

    def _copy_back(self, tensor_id: int) -> torch.Tensor:
        copy = self._tracker.pop(tensor_id, None)
        if copy is None:
            raise RuntimeError(
                f"offloaded activation {tensor_id} is not tracked any more: backward must run before the "
                "offload context exits or the engine is reset"
            )
        with self._on(self._copy_stream()):
            # Fresh storage from offset 0: the source's storage offset would index past the buffer.
            restored = torch.empty_strided(copy.size, copy.stride, dtype=copy.buffer.dtype, device=copy.device)
            restored.copy_(copy.buffer, non_blocking=self.use_streams)
        if self.use_streams:
            compute = self.compute_stream
            done = self.s1.record_event()
            compute.wait_event(done)
            self._keep_alive_for(restored, compute)
            self._pending_cpu_buffers.append((copy.key, copy.buffer, done))
        else:
            self._pool_cpu_buffer(copy.key, copy.buffer)
        return restored

    def _restore_tensor(self, tensor_id: int, cache: bool = True) -> torch.Tensor:
        # `cache` lets one id be unpacked again (a second backward with retain_graph) until exit.
        if cache and tensor_id in self._restored:
            return self._restored[tensor_id]
        kept = self._keep_last.pop(tensor_id, None)
        if kept is not None:
            self.stats.kept_last_tensors += 1
            result = kept
        else:
            stashed = self._fwd_stash.pop(tensor_id, None)
            if stashed is not None:
                # The source is still alive: skip the copy back, only wait until the side stream
                # stopped reading it, and give its host buffer back.
                result, event = stashed
                self.compute_stream.wait_event(event)
                copy = self._tracker.pop(tensor_id)
                self._pool_cpu_buffer(copy.key, copy.buffer)
            else:
                result = self._copy_back(tensor_id)
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += _num_bytes(result)
        if cache:
            self._restored[tensor_id] = result
        return result

    # -- end of a step -------------------------------------------------------------------------
    def _sync_copy_streams(self) -> None:
        if self.use_streams:
            self.s1.synchronize()
            self._reap_cpu_buffer_pool(wait=True)

    def _clear_state(self) -> None:
        self._tracker.clear()
        self._fwd_stash.clear()
        self._keep_last.clear()
        self._restored.clear()
        self._pending_cpu_buffers.clear()

    def reset(self) -> None:
        """Wait for copies in flight, then forget every tensor and zero the stats (buffers stay pooled)."""
        self._sync_copy_streams()
        self._clear_state()
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0

    def _sync_and_clear(self) -> None:
        # At context exit: host copies backward never asked for go back to the pool.
        self._sync_copy_streams()
        for copy in self._tracker.values():
            self._pool_cpu_buffer(copy.key, copy.buffer)
        self._clear_state()
