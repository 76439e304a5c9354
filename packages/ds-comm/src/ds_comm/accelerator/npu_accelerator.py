"""`deepspeed.accelerator.npu_accelerator`:
Huawei Ascend NPUs through `torch.npu` (registered by torch_npu), collectives over HCCL.
"""

from __future__ import annotations

from ds_comm.accelerator._device_module import TorchDeviceAccelerator


class NPU_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's name
    """An Ascend NPU."""

    name = "npu"
    plugin_module = "torch_npu"
    plugin_distribution = "torch-npu"
    backend_name = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"


__all__ = ["NPU_Accelerator"]
