"""`deepspeed.accelerator.mps_accelerator`:
Apple silicon GPUs through torch's `torch.mps`: one device, no fp64, collectives over gloo.
"""

from __future__ import annotations

import torch

from ds_comm.accelerator._device_module import TorchDeviceAccelerator


class MPS_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's name
    """The Apple silicon GPU (always one device, index 0)."""

    name = "mps"
    backend_name = "gloo"
    fp64_supported = False
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def is_bf16_supported(self) -> bool:
        # MPS has bf16 kernels from macOS 14 (Sonoma) on.
        return self.is_available() and torch.backends.mps.is_macos_or_newer(14, 0)

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("mps", 0)

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        torch.mps.synchronize()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return int(torch.mps.current_allocated_memory())

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return int(torch.mps.driver_allocated_memory())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        return None

    def total_memory(self, device_index: int | None = None) -> int:
        return int(torch.mps.recommended_max_memory())

    def available_memory(self, device_index: int | None = None) -> int:
        return self.total_memory() - self.memory_allocated()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return int(torch.mps.driver_allocated_memory())

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.memory_reserved()

    def manual_seed_all(self, seed: int) -> None:
        torch.mps.manual_seed(seed)  # one device: seeding it is seeding all

    def initial_seed(self) -> int:
        return int(torch.initial_seed())

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.mps.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.mps._get_default_mps_generator()


__all__ = ["MPS_Accelerator"]
