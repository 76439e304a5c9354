"""`deepspeed.runtime.swap_tensor`: DeepSpeed's NVMe swap size constants, under its path.

Code sizes models and buffers with these (DeepSpeed's tests make a layer `MIN_SWAPPABLE_BYTES` wide so it
is big enough to be swapped). The values are DeepSpeed's. ds's NVMe offload (ds-zero) swaps every
partition whatever its size, so a tensor at least this big is swapped by both.
"""

from __future__ import annotations

__all__ = ["AIO_ALIGNED_BYTES", "MIN_AIO_BYTES", "MIN_SWAPPABLE_BYTES"]

#: The smallest transfer DeepSpeed hands its async I/O engine (1 MiB).
MIN_AIO_BYTES = 1024**2
#: The alignment of DeepSpeed's swap buffers and files (1 KiB).
AIO_ALIGNED_BYTES = 1024
#: The size from which DeepSpeed swaps a tensor to NVMe instead of keeping it in memory.
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES
