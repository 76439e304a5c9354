"""`deepspeed.accelerator.hpu_accelerator`:
Intel Gaudi HPUs through `torch.hpu` (registered by habana_frameworks), collectives over HCCL.
"""

from __future__ import annotations

from ds_comm.accelerator._device_module import TorchDeviceAccelerator


class HPU_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's name
    """A Gaudi HPU."""

    name = "hpu"
    plugin_module = "habana_frameworks.torch"
    plugin_distribution = "habana-torch-plugin"
    backend_name = "hccl"
    # Gaudi containers select cards otherwise (HABANA_VISIBLE_MODULES); DeepSpeed keeps CUDA's variable.
    visible_devices_env = "CUDA_VISIBLE_DEVICES"

    def get_compile_backend(self) -> str:
        return getattr(self, "_compile_backend", "hpu_backend")


__all__ = ["HPU_Accelerator"]
