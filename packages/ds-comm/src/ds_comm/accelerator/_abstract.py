"""The interface every accelerator implements, so no package branches on device type."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from ds_comm.accelerator._pinning import HostPinning


class Accelerator(HostPinning, abc.ABC):
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

    def is_fp64_supported(self) -> bool:
        """Whether float64 tensors work on this device (False where the device has no fp64, e.g. mps)."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """Training dtypes this accelerator supports, fp32 first."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    # Memory (pinning: `HostPinning`)
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

    def initial_seed(self) -> int:
        """The seed the device's default generator started from."""
        return torch.initial_seed()

    def random(self) -> Any:
        """The module that holds the RNG functions (`torch.random` for both cpu and cuda)."""
        return torch.random

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The generator state of `device_index` (the current device when None) as a byte tensor."""

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a state from `get_rng_state`."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """The default `torch.Generator` of device `device_index`."""

    # Execution model: DeepSpeed's timers and swappers ask these instead of testing the device type.
    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """Whether work runs synchronously with the host (cpu), so host clocks time it and no sync is needed."""

    def use_host_timers(self) -> bool:
        """Time with `time.perf_counter` rather than device events."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether ordering between producer and consumer is implicit (no stream waits needed)."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether memory is freed as soon as work finishes (no allocator back-pressure to manage)."""
        return self.is_synchronized_device()

    def current_device_name(self) -> str:
        """`torch.device` string of the current device (`"cpu"`, `"cuda:1"`)."""
        return self.device_name(self.current_device())

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on a device of this kind."""
        return tensor.device.type == self.name

    # Streams, events and graphs (None / no-op context on a synchronous device).
    @property
    def Stream(self) -> type | None:  # noqa: N802 - DeepSpeed's name
        """The stream class, or None where the device has no streams."""
        return None

    @property
    def Event(self) -> type | None:  # noqa: N802 - DeepSpeed's name
        """The event class, or None where the device has no events."""
        return None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context that makes `stream` current (a no-op context without streams)."""
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        """The current stream, or None without streams."""
        return None

    def default_stream(self, device_index: int | None = None) -> Any:
        """The default stream, or None without streams."""
        return None

    def create_graph(self) -> Any:
        """A new capture graph, or None where graphs are not supported."""
        return None

    def capture_to_graph(
        self, graph: Any, pool: Any = None, stream: Any = None
    ) -> contextlib.AbstractContextManager[Any]:
        """Context that records into `graph` (a no-op context without graphs)."""
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        """Replay a captured graph (nothing to do without graphs)."""
        return None

    # Profiler ranges and deferred calls.
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        """Open a named profiler range (recorded by the device profiler where one exists)."""
        return None

    def range_pop(self, domain: Any = None) -> None:
        """Close the innermost profiler range."""
        return None

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run `callback` once the device is initialised (now, on a device without lazy init)."""
        return callback()

    # More memory figures, under DeepSpeed's names (cached == reserved on both backends).
    def empty_cache(self) -> None:
        """Return cached, unused memory to the system (nothing is cached on cpu)."""
        return None

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Alias of `reset_peak_memory_stats`."""
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the allocator (cpu: the RSS, as for `memory_allocated`)."""
        return self.memory_allocated(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of `memory_reserved`."""
        return self.max_memory_allocated(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        """DeepSpeed's older name for `memory_reserved`."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """DeepSpeed's older name for `max_memory_reserved`."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Alias of `reset_peak_memory_stats`."""
        self.reset_peak_memory_stats(device_index)

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes that can still be allocated on the device (cpu: the kernel's MemAvailable)."""

    # Typed tensor constructors, as DeepSpeed exposes them.
    @abc.abstractmethod
    def _tensor_constructor(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """A callable that builds a tensor of `dtype` on this device."""

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_constructor(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_constructor(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_constructor(torch.float64)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_constructor(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_constructor(torch.float16)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_constructor(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:  # noqa: N802 - DeepSpeed's name
        return self._tensor_constructor(torch.int64)

    # Launcher and compiler hooks.
    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run on this device."""
        return False

    def export_envs(self) -> list[str]:
        """Prefixes of environment variables the launcher forwards to every node (cuda: `NCCL`)."""
        return []

    def visible_devices_envs(self) -> list[str]:
        """Variables that restrict the devices a process sees (`CUDA_VISIBLE_DEVICES`, also on cpu)."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(
        self,
        current_env: MutableMapping[str, str],
        local_accelerator_ids: Sequence[int],
    ) -> None:
        """Write `local_accelerator_ids`, comma-joined, into every variable of `visible_devices_envs()`."""
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(str(i) for i in local_accelerator_ids)

    def get_compile_backend(self) -> str:
        """The `torch.compile` backend (default `"inductor"`)."""
        return getattr(self, "_compile_backend", "inductor")

    def set_compile_backend(self, backend: str) -> None:
        """Use `backend` for `torch.compile`.

        Raises:
            ValueError: `backend` is not one torch._dynamo knows (the message lists them).
        """
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"compile backend {backend!r} is not supported on {self.name}; known backends: {known}")
        self._compile_backend = backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
