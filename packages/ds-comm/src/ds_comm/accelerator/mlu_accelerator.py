"""`deepspeed.accelerator.mlu_accelerator`:
Cambricon MLUs through `torch.mlu` (registered by torch_mlu), collectives over CNCL.
"""

from __future__ import annotations

from ds_comm.accelerator._device_module import TorchDeviceAccelerator


class MLU_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's name
    """A Cambricon MLU."""

    name = "mlu"
    plugin_module = "torch_mlu"
    plugin_distribution = "torch_mlu"
    backend_name = "cncl"
    visible_devices_env = "MLU_VISIBLE_DEVICES"


__all__ = ["MLU_Accelerator"]
