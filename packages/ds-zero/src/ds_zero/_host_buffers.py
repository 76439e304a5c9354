"""Host buffers for optimizer offload: page-locked when asked and pinning does something, else huge pages,
and their release when the optimizer is destroyed.

[Note: when to pin] Pinned memory speeds up host-device copies; the CPU optimizer streams fp32 partitions
faster from transparent huge pages (ds_ops.host_memory). So an offload buffer is pinned when
`offload_optimizer.pin_memory` asks for it and the accelerator really page-locks (a CUDA runtime, or the
native backend, DS_PIN_MEMORY_BACKEND=native); otherwise it goes into huge pages. Under the native
backend, `release_pinned()` frees the buffers at `destroy()` instead of at garbage collection.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import ds_comm
from ds_ops.host_memory import huge_page_zeros

__all__ = ["offload_zeros", "release_pinned"]


def offload_zeros(numel: int, *, pin_memory: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D host buffer of `numel` zeros in `dtype` (fp32 masters, or bf16 ones with
    `bf16.bf16_master_weights_and_grads`): pinned through the accelerator (see the note), else in huge pages."""
    accelerator = ds_comm.get_accelerator()
    if pin_memory and accelerator.pins_host_memory():
        buffer = accelerator.pin_memory(torch.empty(numel, dtype=dtype), make_copy=False)
        return buffer.zero_()
    return huge_page_zeros(numel, dtype)


def release_pinned(buffers: Iterable[torch.Tensor]) -> int:
    """Free each buffer the accelerator pinned natively (`unpin_memory`); returns how many were freed.

    With the torch backend this frees nothing: torch's pinned memory goes when its last reference does.
    The buffers, and every view of them, must not be used afterwards.
    """
    accelerator = ds_comm.get_accelerator()
    freed = 0
    for buffer in buffers:
        if accelerator.is_pinned(buffer) and accelerator.unpin_memory(buffer):
            freed += 1
    return freed
