"""`deepspeed.accelerator.sdaa_accelerator`:
Tecorigin SDAA cards through `torch.sdaa` (registered by torch_sdaa), collectives over TCCL.
"""

from __future__ import annotations

from ds_comm.accelerator._device_module import TorchDeviceAccelerator


class SDAA_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's name
    """A Tecorigin SDAA card."""

    name = "sdaa"
    plugin_module = "torch_sdaa"
    plugin_distribution = "torch_sdaa"
    backend_name = "tccl"
    visible_devices_env = "SDAA_VISIBLE_DEVICES"


__all__ = ["SDAA_Accelerator"]
