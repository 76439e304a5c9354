"""`deepspeed.accelerator.xpu_accelerator`:
Intel GPUs through torch's built-in `torch.xpu`, collectives over XCCL (CCL with oneCCL's bindings).
"""

from __future__ import annotations

import importlib

from ds_comm.accelerator._device_module import TorchDeviceAccelerator


class XPU_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's name
    """An Intel GPU."""

    name = "xpu"
    visible_devices_env = "ZE_AFFINITY_MASK"

    def __init__(self) -> None:
        super().__init__()
        # oneCCL's bindings register the `ccl` backend; torch itself (2.8+) brings `xccl`.
        try:
            importlib.import_module("oneccl_bindings_for_pytorch")
        except ImportError:
            self._backend = "xccl"
        else:
            self._backend = "ccl"

    def communication_backend_name(self) -> str:
        return self._backend


__all__ = ["XPU_Accelerator"]
