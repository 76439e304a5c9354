"""`deepspeed.accelerator.klxpu_accelerator`: Kunlunxin XPUs, which torch_xmlir presents as `torch.cuda`.

Everything but the name and the timers is the CUDA accelerator's: device strings, streams, RNG and
memory go through `torch.cuda`.
"""

from __future__ import annotations

import os

from ds_comm.accelerator._cuda import CudaAccelerator


class KLXPU_Accelerator(CudaAccelerator):  # noqa: N801 - DeepSpeed's name
    """A Kunlunxin XPU behind the CUDA interface."""

    name = "klxpu"

    def use_host_timers(self) -> bool:
        """Host timers unless XPU_EVENT_KL3_ENABLE=1: without it the device's events time everything as 0.0."""
        return os.environ.get("XPU_EVENT_KL3_ENABLE", "0") != "1"

    def is_triton_supported(self) -> bool:
        return False

    def range_push(self, msg: str, domain: object = None, category: object = None) -> None:
        return None  # no NVTX on this device

    def range_pop(self, domain: object = None) -> None:
        return None


__all__ = ["KLXPU_Accelerator"]
