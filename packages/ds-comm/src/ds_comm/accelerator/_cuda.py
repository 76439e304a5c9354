"""CUDA accelerator: nccl, the caching allocator's statistics."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

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

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """cudaHostRegister the range, so copies from native pinned buffers run as DMA; False if CUDA refuses."""
        if not torch.cuda.is_available():
            return False
        return int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)) == 0

    def unregister_host_memory(self, address: int) -> None:
        """cudaHostUnregister the range that starts at `address`.

        Raises:
            RuntimeError: CUDA refused (the range stays registered, so its memory must not be freed).
        """
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
        if code != 0:
            raise RuntimeError(f"cudaHostUnregister(0x{address:x}) failed with CUDA error {code}")

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

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state() if device_index is None else torch.cuda.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def is_synchronized_device(self) -> bool:
        return False

    @property
    def Stream(self) -> type:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream

    @property
    def Event(self) -> type:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes as the driver reports them (other processes' allocations included)."""
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """Ours plus the caching allocator's full statistics (`torch.cuda.memory_stats`), as DeepSpeed returns."""
        return {**torch.cuda.memory_stats(device_index), **super().memory_stats(device_index)}

    def _tensor_constructor(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device="cuda")

    def is_triton_supported(self) -> bool:
        """Ampere (sm80) or newer, as DeepSpeed decides."""
        return self.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def export_envs(self) -> list[str]:
        return ["NCCL"]
