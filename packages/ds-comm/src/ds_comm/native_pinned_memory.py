"""The native pinned-memory backend (`DS_PIN_MEMORY_BACKEND=native`): page-locked host tensors whose
lifetime ds controls, and the switch between it and torch's pinning. DeepSpeed's `deepspeed.utils.pin_memory`.

[Note: why a second backend] `tensor.pin_memory()` needs a device runtime (it fails on a CPU-only
build) and the memory is freed only when Python drops the last reference, so a ZeRO offload buffer
stays locked until garbage collection. The native backend locks memory with mlock on any POSIX host
and can free it at a known moment (`Accelerator.unpin_memory`, which ZeRO's `destroy()` calls), and it
still frees by itself, like torch's, when every view of a buffer is gone.

The accelerator is the one dispatcher: `pin_memory`, `pin_empty`, `is_pinned` and `unpin_memory` ask
`get_active_native_pinned_memory()` on every call (the variable is read each time, as in DeepSpeed), and
all of them share one `NativePinnedMemory` per process, so a range pinned by one package is seen as
pinned by every other.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ds_comm._locked_host_allocator import locked_host_allocator

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_ENV",
    "REGISTER_DEVICE_ENV",
    "HostRegistrar",
    "NativePinnedMemory",
    "PinHandle",
    "get_active_native_pinned_memory",
    "get_native_pinned_memory",
    "native_backend_selected",
    "set_pin_handle_loader",
]

#: `torch` (default: the accelerator's own pinning) or `native` (this module).
BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"
#: Whether native buffers are also registered with the device runtime (cudaHostRegister); default on.
REGISTER_DEVICE_ENV = "DS_PIN_MEMORY_REGISTER_DEVICE"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class PinHandle(Protocol):
    """What hands out and takes back page-locked buffers (`ds_comm`'s libc allocator, or the pin_memory op's)."""

    def new_cpu_locked_tensor(self, numel: int, example: torch.Tensor) -> torch.Tensor: ...

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool: ...


class HostRegistrar(Protocol):
    """A device runtime that can map host memory for fast copies (the accelerator: cudaHostRegister)."""

    def register_host_memory(self, address: int, num_bytes: int) -> bool: ...

    def unregister_host_memory(self, address: int) -> None: ...

    def pin_memory_alignment(self) -> int: ...


_handle_loader: Callable[[], PinHandle] = locked_host_allocator


def set_pin_handle_loader(loader: Callable[[], PinHandle] | None) -> None:
    """Where `NativePinnedMemory()` gets its allocator (None: ds-comm's libc allocator).

    `deepspeed.ops.op_builder` points this at its `PinMemoryBuilder`, so that a DeepSpeed script that
    replaces that builder gets what it built.
    """
    global _handle_loader
    _handle_loader = locked_host_allocator if loader is None else loader


def _registration_enabled() -> bool:
    value = os.environ.get(REGISTER_DEVICE_ENV, "1").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{REGISTER_DEVICE_ENV}={value!r} is not a boolean; use one of {', '.join(_TRUE + _FALSE)}")


def _aligned_down(address: int, alignment: int) -> int:
    return address if alignment <= 1 else address - address % alignment


def _has_storage(tensor: torch.Tensor) -> bool:
    # Meta and fake tensors have no memory to look up; asking for their data_ptr warns or raises.
    if tensor.device.type == "meta":
        return False
    from torch._subclasses.fake_tensor import is_fake  # noqa: PLC0415 - torch internals, only when asked

    return not is_fake(tensor)


class NativePinnedMemory:
    """Page-locked host tensors with explicit `unpin()` and a free when the last view dies.

    `_ranges` (base address -> end address of each live allocation) keeps DeepSpeed's name: its tests
    count it. A returned tensor carries `ds_pinned = True` and `ds_pin_base` (its allocation's base),
    which survive a later `.data` swap so `unpin()` still frees the right memory.

    Raises:
        RuntimeError: the allocator could not be loaded (the message names the pin_memory op).
    """

    def __init__(self, handle: PinHandle | None = None) -> None:
        self._ranges: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self._device_registered: dict[int, HostRegistrar] = {}  # base -> the runtime it is registered with
        if handle is None:
            try:
                handle = _handle_loader()
            except Exception as err:
                raise RuntimeError(
                    f"{BACKEND_ENV}=native needs the pin_memory op (page-locked host memory), which failed to "
                    f"load: {err}"
                ) from err
        self._handle = handle

    def pin(
        self,
        tensor: torch.Tensor,
        make_copy: bool = True,
        match_shape: bool = True,
        *,
        registrar: HostRegistrar | None = None,
    ) -> torch.Tensor:
        """A page-locked tensor like `tensor`: its values (`make_copy`), its shape or flat (`match_shape`).

        `registrar` (the accelerator that asks) also maps the buffer into its device runtime, unless
        `DS_PIN_MEMORY_REGISTER_DEVICE` is off; a failed registration leaves the buffer mlocked only.
        """
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(),)
        locked = self._new_locked(tensor, shape, registrar)
        if make_copy:
            locked.copy_(tensor.reshape(shape))
        return locked

    def pin_empty(
        self, example: torch.Tensor, shape: Sequence[int], *, registrar: HostRegistrar | None = None
    ) -> torch.Tensor:
        """An uninitialized page-locked tensor of `shape` and `example`'s dtype (`example` may be empty)."""
        return self._new_locked(example, tuple(int(dim) for dim in shape), registrar)

    def _new_locked(
        self, example: torch.Tensor, shape: tuple[int, ...], registrar: HostRegistrar | None
    ) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= int(dim)
        if numel == 0:  # nothing to lock; an empty tensor has no address to track
            empty = example.new_empty(shape)
            empty.ds_pinned = True  # type: ignore[attr-defined]
            return empty
        buffer = self._handle.new_cpu_locked_tensor(numel, example)
        # The view root owns the allocation: every view of the result keeps it alive through `._base`,
        # so its finalizer runs only after the last view is gone. The finalizer frees by address
        # (holding the root itself would keep it alive forever).
        root = buffer if buffer._base is None else buffer._base
        begin = buffer.data_ptr()
        if registrar is not None:
            self._register_device(registrar, begin, buffer.nbytes)
        self._ranges[begin] = begin + buffer.nbytes
        self._finalizers[begin] = weakref.finalize(
            root, _release, self._handle, begin, self._ranges, self._finalizers, self._device_registered
        )
        locked = buffer[:numel].view(shape)
        locked.ds_pinned = True  # type: ignore[attr-defined]
        locked.ds_pin_base = begin  # type: ignore[attr-defined]
        return locked

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (or the allocation it views into) is one of ours and still live."""
        if getattr(tensor, "ds_pinned", False):
            return True
        if not _has_storage(tensor) or tensor.device.type != "cpu":
            return False
        address = tensor.data_ptr()
        # a copy: a finalizer run by garbage collection mid-iteration would change the dict under us
        return any(begin <= address < end for begin, end in self._ranges.copy().items())

    def unpin(self, tensor: torch.Tensor) -> bool:
        """Free `tensor`'s allocation now; True when one was freed. Any view of it must not be used after."""
        begin = getattr(tensor, "ds_pin_base", None)
        if begin is None:
            begin = tensor.data_ptr()
        _unregister_device(begin, self._device_registered)
        finalizer = self._finalizers.pop(begin, None)
        if finalizer is not None:
            finalizer.detach()  # the free happens here, not again at garbage collection
        freed = self._handle.free_cpu_locked_tensor_by_ptr(begin)
        self._ranges.pop(begin, None)
        if hasattr(tensor, "ds_pinned"):
            tensor.ds_pinned = False
        return freed

    def _register_device(self, registrar: HostRegistrar, begin: int, num_bytes: int) -> None:
        if num_bytes == 0 or not _registration_enabled():
            return
        # Some runtimes register whole pages only: start at the aligned address, cover the request.
        start = _aligned_down(begin, registrar.pin_memory_alignment())
        try:
            if registrar.register_host_memory(start, num_bytes + begin - start):
                self._device_registered[begin] = registrar
        except Exception as err:  # noqa: BLE001 - the memory is still mlocked; only the device's fast path is lost
            logger.warning("native pinned memory: device registration failed, using mlock only: %s", err)


def _unregister_device(begin: int, registered: dict[int, HostRegistrar]) -> None:
    registrar = registered.get(begin)
    if registrar is None:
        return
    # Unregister before the free: a runtime left holding pages that malloc hands out again is worse
    # than a leak, so a failure here propagates and the memory stays allocated.
    registrar.unregister_host_memory(_aligned_down(begin, registrar.pin_memory_alignment()))
    del registered[begin]


def _release(
    handle: PinHandle,
    begin: int,
    ranges: dict[int, int],
    finalizers: dict[int, weakref.finalize[Any, Any]],
    registered: dict[int, HostRegistrar],
) -> None:
    """The garbage-collection free of one allocation (module level: it must not hold the tensor)."""
    try:
        _unregister_device(begin, registered)
    except Exception:  # noqa: BLE001 - a runtime already torn down: keep the pages rather than free registered ones
        return
    ranges.pop(begin, None)
    finalizers.pop(begin, None)
    try:
        handle.free_cpu_locked_tensor_by_ptr(begin)
    except Exception:  # noqa: BLE001 - interpreter shutdown: process exit releases everything anyway
        return


#: The process-wide manager (DeepSpeed's name); built on first use of the native backend.
_shared_native_pins: NativePinnedMemory | None = None


def get_native_pinned_memory() -> NativePinnedMemory:
    """The process-wide `NativePinnedMemory`, built on first call."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def native_backend_selected() -> bool:
    """Whether `DS_PIN_MEMORY_BACKEND` says `native` (read now; unset means `torch`).

    Raises:
        ValueError: the variable holds something other than `torch` or `native`.
    """
    value = os.environ.get(BACKEND_ENV, "torch").strip().lower()
    if value not in ("torch", "native"):
        raise ValueError(f"{BACKEND_ENV}={value!r} is not a pinned-memory backend; use 'torch' or 'native'")
    return value == "native"


def get_active_native_pinned_memory() -> NativePinnedMemory | None:
    """The shared manager when the native backend is selected, else None (the accelerator pins with torch).

    Raises:
        RuntimeError: native is selected but the allocator cannot be loaded; there is no silent fallback.
        ValueError: `DS_PIN_MEMORY_BACKEND` holds an unknown value.
    """
    if not native_backend_selected():
        return None
    return get_native_pinned_memory()
