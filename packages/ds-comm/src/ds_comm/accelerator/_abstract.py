"""The interface every accelerator implements, so no package branches on device type."""

from __future__ import annotations

import abc
from typing import Any

import torch


class Accelerator(abc.ABC):
    """One kind of device (cpu, cuda) as ds sees it.

    Code above ds-comm asks the accelerator instead of testing `torch.cuda.is_available()`,
    so supporting another device type means adding one implementation here.
    """

    #: Short name used by `DS_ACCELERATOR` and in messages ("cpu", "cuda").
    name: str = ""

    # Devices
    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str:
        """`"cuda"` or `"cuda:1"` style string for `torch.device`."""

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> torch.device:
        """The `torch.device` for `device_index` (the current device when None)."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind on this host (CPU: 1)."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of the current device."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make `device_index` the current device (a no-op on CPU)."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all queued work on the device (a no-op on CPU)."""

    def is_available(self) -> bool:
        """Whether this accelerator can run here."""
        return True

    # Communication
    @abc.abstractmethod
    def communication_backend_name(self) -> str:
        """torch.distributed backend that suits this device ("nccl", "gloo")."""

    # Numerics
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bf16 math runs natively enough to train in."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether fp16 math runs natively enough to train in."""

    def supported_dtypes(self) -> list[torch.dtype]:
        """Training dtypes this accelerator supports, fp32 first."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # Memory
    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of `tensor` where that helps host↔device copies; else `tensor`."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is page-locked."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes currently held by tensors (CPU: process resident set size)."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak bytes since start or the last `reset_peak_memory_stats` (CPU: peak RSS)."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Start a new peak measurement where the platform allows it."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """Bytes of memory on the device (CPU: physical RAM)."""

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """The figures above in one dict, for logs and `ds_report`."""
        return {
            "allocated_bytes": self.memory_allocated(device_index),
            "max_allocated_bytes": self.max_memory_allocated(device_index),
            "total_bytes": self.total_memory(device_index),
        }

    # RNG
    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the device's generator(s)."""

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator."""
        self.manual_seed(seed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
