"""CPU accelerator: gloo, RSS-based memory figures."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Sequence

import torch

from ds_comm.accelerator._abstract import Accelerator
from ds_comm.accelerator._numa import count_numa_devices

#: The legacy typed constructors DeepSpeed's CPU accelerator hands out (`FloatTensor(3)` is a size-3 tensor).
_LEGACY_TENSOR_TYPES = {
    torch.bfloat16: "BFloat16Tensor",
    torch.uint8: "ByteTensor",
    torch.float64: "DoubleTensor",
    torch.float32: "FloatTensor",
    torch.float16: "HalfTensor",
    torch.int32: "IntTensor",
    torch.int64: "LongTensor",
}


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
        """`$LOCAL_SIZE` when set and positive (the launcher's ranks per node), else the NUMA nodes with cores.

        DeepSpeed treats each NUMA node as one CPU device, and its launcher sizes the local pool from this.
        """
        local_size = os.environ.get("LOCAL_SIZE", "").strip()
        if local_size:
            try:
                value = int(local_size)
            except ValueError:
                raise ValueError(f"LOCAL_SIZE={local_size!r} is not an integer (ranks on this node)") from None
            if value > 0:
                return value
        return count_numa_devices()

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

    # torch cannot page-lock without a device runtime (pin_memory() fails on a CPU-only build), and with no
    # device there is no copy to speed up: the torch backend leaves tensors as they are. The native
    # backend (DS_PIN_MEMORY_BACKEND=native) does lock them.
    _torch_pins_host_memory = False

    def _torch_pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _torch_empty_pinned(self, template: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return template.new_empty(tuple(shape))

    def _torch_is_pinned(self, tensor: torch.Tensor) -> bool:
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

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    def is_synchronized_device(self) -> bool:
        return True

    def available_memory(self, device_index: int | None = None) -> int:
        """The kernel's MemAvailable (free plus reclaimable), else free physical pages."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        """Ours plus DeepSpeed's two cpu keys (`allocated_bytes.all.current`/`.peak`, both RSS figures)."""
        stats = super().memory_stats(device_index)
        stats["allocated_bytes.all.current"] = stats["allocated_bytes"]
        stats["allocated_bytes.all.peak"] = stats["max_allocated_bytes"]
        return stats

    def _tensor_constructor(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return getattr(torch, _LEGACY_TENSOR_TYPES[dtype])
