"""`deepspeed.accelerator.cuda_accelerator`: NVIDIA GPUs (ds_comm's `CudaAccelerator`)."""

from __future__ import annotations

from ds_comm.accelerator._cuda import CudaAccelerator as CUDA_Accelerator  # noqa: N814 - DeepSpeed's name

__all__ = ["CUDA_Accelerator"]
