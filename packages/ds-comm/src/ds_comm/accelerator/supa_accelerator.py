"""`deepspeed.accelerator.supa_accelerator`:
Biren SUPA GPUs through `torch.supa` (registered by torch_br), collectives over BCCL.
"""

from __future__ import annotations

import sys

from ds_comm.accelerator._device_module import TorchDeviceAccelerator


class SUPA_Accelerator(TorchDeviceAccelerator):  # noqa: N801 - DeepSpeed's name
    """A Biren SUPA GPU."""

    name = "supa"
    plugin_module = "torch_br"
    plugin_distribution = "torch_br"
    backend_name = "bccl" if sys.platform != "win32" else "gloo"
    visible_devices_env = "SUPA_VISIBLE_DEVICES"


__all__ = ["SUPA_Accelerator"]
