"""Host-memory pinning on the accelerator: one dispatch between the native backend and torch's pinning.

Every public method asks `get_active_native_pinned_memory()` first (DS_PIN_MEMORY_BACKEND is read on each
call); with the torch backend it falls back to the `_torch_*` primitives, which an accelerator overrides
for its device. Bytes really locked are added to the process-wide pinned total (ds_comm's tracker).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds_comm._pinned_memory import track_pinned_memory
from ds_comm.native_pinned_memory import get_active_native_pinned_memory

__all__ = ["HostPinning"]


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel


def _require_host(device: str | torch.device, what: str) -> None:
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"{what}: device must be 'cpu' (pinned memory is host memory), got {device!r}") from err
    if kind != "cpu":
        raise ValueError(f"{what}: device must be 'cpu' (pinned memory is host memory), got {device!r}")


class HostPinning:
    """DeepSpeed's pinning methods of an accelerator (mixed into `Accelerator`)."""

    #: Whether `_torch_pin_memory` really page-locks (False on the CPU accelerator: torch cannot there).
    _torch_pins_host_memory: bool = True

    # ---- the device's own primitives (torch backend) -------------------------------------------------
    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def _torch_empty_pinned(self, template: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return template.new_empty(tuple(shape), pin_memory=True)

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    # ---- the device runtime's view of native buffers -------------------------------------------------
    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Register `num_bytes` of locked host memory at `address` with the device runtime; False: not done."""
        return False

    def unregister_host_memory(self, address: int) -> None:
        """Undo `register_host_memory(address, ...)`."""
        return None

    def pin_memory_alignment(self) -> int:
        """The byte alignment the runtime needs for registered host ranges (1: none)."""
        return 1

    # ---- the public API ---------------------------------------------------------------------------
    def pins_host_memory(self) -> bool:
        """Whether `pin_memory` really page-locks here: the native backend is selected, or the device's
        torch pinning does (False on the CPU accelerator with the torch backend, where it is a no-op)."""
        return get_active_native_pinned_memory() is not None or self._torch_pins_host_memory

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """A page-locked version of `tensor` (on the CPU accelerator with the torch backend: `tensor` itself).

        Args:
            tensor: the host tensor to pin.
            make_copy: copy `tensor`'s values (False: `tensor` only gives shape and dtype, values are undefined).
            match_shape: keep `tensor`'s shape (False: a flat buffer of `tensor.numel()` elements).
        """
        pins = get_active_native_pinned_memory()
        if pins is not None:
            track_pinned_memory(tensor.nbytes)
            return pins.pin(tensor, make_copy=make_copy, match_shape=match_shape, registrar=self)
        if not make_copy:
            # `tensor` is only a template: lock fresh memory rather than fault in and copy its pages.
            return self._pin_fresh(tensor, tuple(tensor.shape) if match_shape else (tensor.numel(),))
        if not match_shape:
            tensor = tensor.reshape(-1)
        pinned = self._torch_pin_memory(tensor)
        if self._torch_pins_host_memory and pinned is not tensor:
            track_pinned_memory(pinned.nbytes)
        return pinned

    def pin_empty(
        self, *size: int | Sequence[int], dtype: torch.dtype, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """An uninitialized pinned host tensor of `size` (ints, or one tuple) and `dtype`.

        Raises:
            ValueError: `device` is not the host.
        """
        _require_host(device, "pin_empty")
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], Sequence) else tuple(size)
        return self._pin_fresh(torch.empty(0, dtype=dtype), shape)  # type: ignore[arg-type]

    def pin_empty_like(
        self, tensor: torch.Tensor, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """An uninitialized pinned host tensor with `tensor`'s shape (and dtype unless given)."""
        _require_host(device, "pin_empty_like")
        template = torch.empty(0, dtype=tensor.dtype if dtype is None else dtype)
        return self._pin_fresh(template, tuple(tensor.shape))

    def _pin_fresh(self, template: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        pins = get_active_native_pinned_memory()
        if pins is not None or self._torch_pins_host_memory:
            track_pinned_memory(_numel(shape) * template.element_size())
        if pins is not None:
            return pins.pin_empty(template, shape, registrar=self)
        return self._torch_empty_pinned(template, shape)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in pinned memory: a native buffer (views included) or torch's pinned memory."""
        pins = get_active_native_pinned_memory()
        if pins is not None and pins.is_pinned(tensor):
            return True
        if tensor.device.type == "meta":
            return False
        return self._torch_is_pinned(tensor)

    def unpin_memory(self, tensor: torch.Tensor) -> bool | None:
        """Free a native buffer now (True when freed); None with the torch backend, whose memory is freed
        when the last reference goes. Any view of a freed buffer must not be used afterwards."""
        pins = get_active_native_pinned_memory()
        if pins is None:
            return None
        return pins.unpin(tensor)
