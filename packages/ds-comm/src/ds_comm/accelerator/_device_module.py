"""`TorchDeviceAccelerator`: an accelerator for any device whose runtime is a `torch.<name>` module.

[Note: one class for the vendor devices] XPU, MPS, Ascend NPU, Cambricon MLU, Gaudi HPU and the other
devices DeepSpeed lists all expose their runtime the way `torch.cuda` does (`torch.xpu`,
`torch.npu` once `torch_npu` is imported, ...): `device_count`, `synchronize`, `manual_seed`,
`memory_allocated`, `Stream`. So ds writes that delegation once; each vendor module (`npu_accelerator`,
...) names the device, the plugin to import, the collective backend and what differs. The plugin is
imported when the accelerator is constructed, never when its module is imported, so every vendor
module imports on any host.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

import torch

from ds_comm.accelerator._abstract import Accelerator

__all__ = ["TorchDeviceAccelerator"]


class TorchDeviceAccelerator(Accelerator):
    """A device driven through `torch.<name>`; subclasses set the class variables below.

    Raises (at construction):
        ImportError: the device's plugin (`plugin_module`) is not installed; the message names it.
    """

    #: The torch device type and module (`"xpu"` -> `torch.xpu`).
    name: str = ""
    #: The package that registers the device with torch (`"torch_npu"`); None when torch has it built in.
    plugin_module: ClassVar[str | None] = None
    #: What to `pip install` for the plugin (its distribution name), for the error message.
    plugin_distribution: ClassVar[str | None] = None
    #: The torch.distributed backend for this device.
    backend_name: ClassVar[str] = ""
    #: Whether the device computes in bf16 (None: ask `torch.<name>.is_bf16_supported()`) / fp16 / fp64.
    bf16_supported: ClassVar[bool | None] = None
    fp16_supported: ClassVar[bool] = True
    fp64_supported: ClassVar[bool] = True
    #: The prefix of the variable that hides devices from a process (`ZE_AFFINITY_MASK` style).
    visible_devices_env: ClassVar[str | None] = None

    def __init__(self) -> None:
        if self.plugin_module is not None:
            try:
                importlib.import_module(self.plugin_module)
            except ModuleNotFoundError as err:
                missing = err.name or ""
                if missing != self.plugin_module and not self.plugin_module.startswith(missing + "."):
                    raise  # the plugin is there but something it imports is not: its own error says what
                dist = self.plugin_distribution or self.plugin_module
                raise ImportError(
                    f"the {self.name} accelerator needs {self.plugin_module}: pip install {dist}"
                ) from None

    @property
    def _runtime(self) -> ModuleType:
        runtime = getattr(torch, self.name, None)
        if runtime is None:
            raise RuntimeError(f"torch.{self.name} does not exist: this torch build has no {self.name} support")
        return runtime

    def is_available(self) -> bool:
        runtime = getattr(torch, self.name, None)
        return runtime is not None and bool(runtime.is_available())

    # Devices
    def device_name(self, device_index: int | None = None) -> str:
        return self.name if device_index is None else f"{self.name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.name, self.current_device() if device_index is None else device_index)

    def device_count(self) -> int:
        return int(self._runtime.device_count())

    def current_device(self) -> int:
        return int(self._runtime.current_device())

    def set_device(self, device_index: int) -> None:
        self._runtime.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        self._runtime.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return self.backend_name

    def is_bf16_supported(self) -> bool:
        if self.bf16_supported is not None:
            return self.bf16_supported
        probe = getattr(self._runtime, "is_bf16_supported", None)
        return bool(probe()) if probe is not None else True

    def is_fp16_supported(self) -> bool:
        return self.fp16_supported

    def is_fp64_supported(self) -> bool:
        return self.fp64_supported

    def is_synchronized_device(self) -> bool:
        return False

    def visible_devices_envs(self) -> list[str]:
        return [self.visible_devices_env] if self.visible_devices_env else []

    # Memory
    def memory_allocated(self, device_index: int | None = None) -> int:
        return int(self._runtime.memory_allocated(device_index))

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return int(self._runtime.max_memory_allocated(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._runtime.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        index = self.current_device() if device_index is None else device_index
        return int(self._runtime.get_device_properties(index).total_memory)

    def available_memory(self, device_index: int | None = None) -> int:
        free, _total = self._runtime.mem_get_info(device_index)
        return int(free)

    def empty_cache(self) -> None:
        self._runtime.empty_cache()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return int(self._runtime.memory_reserved(device_index))

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return int(self._runtime.max_memory_reserved(device_index))

    # Random numbers
    def manual_seed(self, seed: int) -> None:
        self._runtime.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._runtime.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return int(self._runtime.initial_seed())

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if device_index is None:
            return self._runtime.get_rng_state()
        return self._runtime.get_rng_state(device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if device_index is None:
            self._runtime.set_rng_state(new_state)
        else:
            self._runtime.set_rng_state(new_state, device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return self._runtime.default_generators[device_index]

    # Streams and events
    @property
    def Stream(self) -> type | None:  # noqa: N802 - DeepSpeed's name
        return getattr(self._runtime, "Stream", None)

    @property
    def Event(self) -> type | None:  # noqa: N802 - DeepSpeed's name
        return getattr(self._runtime, "Event", None)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._runtime.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._runtime.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._runtime.default_stream(device_index)

    def _tensor_constructor(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device=self.name)
