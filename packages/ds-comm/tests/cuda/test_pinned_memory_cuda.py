"""The CUDA accelerator's `pin_memory` counts what it pins, once per tensor."""

from __future__ import annotations

import pytest
import torch

import ds_comm
from ds_comm.accelerator import CudaAccelerator

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pinning_is_tracked_once() -> None:
    cuda = CudaAccelerator()
    ds_comm.pinned_memory_tracker.reset()
    try:
        pinned = cuda.pin_memory(torch.zeros(1024, dtype=torch.float32))
        assert pinned.is_pinned()
        assert cuda.pin_memory(pinned) is pinned  # already pinned: no copy, not counted again
        assert (ds_comm.pinned_memory_tracker.total_bytes, ds_comm.pinned_memory_tracker.calls) == (4096, 1)
    finally:
        ds_comm.pinned_memory_tracker.reset()
