"""`SequenceChunk`: one sequence chunk of an activation, kept in host memory while the accelerator does not need it.

FPDT keeps every chunk's q, k, v, output and input for backward; on an accelerator they would grow with the
sequence, so each lives as a host copy (pinned where the accelerator supports it) and is copied back only
while a block computes with it. On a CPU-only run the host is the device: the chunk is kept as it is.
"""

from __future__ import annotations

import torch

__all__ = ["SequenceChunk"]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return host


class SequenceChunk:
    """A chunk with a host copy (`cpu_chunk`) and, while in use, a device copy (`gpu_chunk`).

    Args:
        chunk: the tensor, on its compute device.
        device: where it computes (default: the chunk's device).
        is_in_use: keep the device copy after making the host copy.
        offload: make a host copy at all (False keeps the chunk on its device: no transfer, no saving).
    """

    def __init__(
        self,
        chunk: torch.Tensor,
        device: torch.device | str | None = None,
        is_in_use: bool = False,
        offload: bool = True,
    ) -> None:
        self.chunk_shape, self.chunk_dtype = chunk.shape, chunk.dtype
        self.device = torch.device(chunk.device if device is None else device)
        self.offloaded = offload and chunk.device.type != "cpu"
        self.cpu_chunk = _host_copy(chunk) if self.offloaded else chunk
        self.gpu_chunk: torch.Tensor | None = chunk if (is_in_use or not self.offloaded) else None

    @property
    def shape(self) -> torch.Size:
        return self.chunk_shape

    def get(self) -> torch.Tensor:
        """The chunk on its device: the resident copy, or a fresh copy from the host that the caller drops."""
        if self.gpu_chunk is not None:
            return self.gpu_chunk
        return self.cpu_chunk.to(self.device, non_blocking=True)

    def load_to_gpu(self) -> None:
        """Bring the host copy to the device (it must not be there already)."""
        if self.gpu_chunk is not None:
            raise RuntimeError("SequenceChunk.load_to_gpu: the chunk is already on the device")
        self.gpu_chunk = self.cpu_chunk.to(self.device, non_blocking=True)

    def get_gpu_chunk(self) -> torch.Tensor:
        self.check_gpu_chunk()
        assert self.gpu_chunk is not None
        return self.gpu_chunk

    def check_gpu_chunk(self) -> bool:
        if self.gpu_chunk is None or self.gpu_chunk.device != self.device:
            raise RuntimeError(f"SequenceChunk: the chunk is not resident on {self.device}; call load_to_gpu()")
        return True

    def offload(self) -> None:
        """Drop the device copy (the host copy stays)."""
        self.check_gpu_chunk()
        if self.offloaded:
            self.gpu_chunk = None

    def overwrite_to_cpu(self) -> None:
        """Write the device copy (changed in place) back to the host copy."""
        self.check_gpu_chunk()
        assert self.gpu_chunk is not None
        if self.offloaded:
            self.cpu_chunk.copy_(self.gpu_chunk, non_blocking=True)
