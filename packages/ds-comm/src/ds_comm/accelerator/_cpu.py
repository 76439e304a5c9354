"""CPU accelerator: gloo, RSS-based memory figures."""

from __future__ import annotations

import os
import resource

import torch

from ds_comm.accelerator._abstract import Accelerator


def _rss_bytes() -> int:
    """Current resident set size of this process, from /proc (Linux) or getrusage."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CpuAccelerator(Accelerator):
    """The host as a single device.

    Memory figures are the process RSS, since CPU tensors come from the general allocator.
    The peak cannot be reset on Linux without privileges, so `reset_peak_memory_stats`
    records the current RSS as a floor and `max_memory_allocated` reports the largest of that
    floor, the kernel's lifetime peak and the current RSS (the two counters are sampled differently).
    """

    name = "cpu"

    def __init__(self) -> None:
        self._peak_floor = 0

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        # fp16 math on CPU works in torch but is slow; it is supported for correctness runs.
        return True

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        # Pinning only matters for copies to a device; with none present it would fail.
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def memory_allocated(self, device_index: int | None = None) -> int:
        return _rss_bytes()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return max(_peak_rss_bytes(), self._peak_floor, _rss_bytes())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._peak_floor = _rss_bytes()

    def total_memory(self, device_index: int | None = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
