"""`deepspeed.accelerator.cpu_accelerator`: the host as the device (ds_comm's `CpuAccelerator`)."""

from __future__ import annotations

from ds_comm.accelerator._cpu import CpuAccelerator as CPU_Accelerator  # noqa: N814 - DeepSpeed's name

__all__ = ["CPU_Accelerator"]
