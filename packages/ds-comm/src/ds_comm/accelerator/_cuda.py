"""CUDA accelerator: nccl, the caching allocator's statistics."""

from __future__ import annotations

import torch

from ds_comm.accelerator._abstract import Accelerator


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs through `torch.cuda`. Nothing touches CUDA until a method is called."""

    name = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.device("cuda", index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        major, _ = torch.cuda.get_device_capability()
        return major >= 6

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)
