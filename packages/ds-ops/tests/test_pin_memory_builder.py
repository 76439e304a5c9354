"""`PinMemoryBuilder` (DeepSpeed's pin_memory op): compatible on POSIX with nothing to build, and its handle
locks, recognises and frees host buffers."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ds_comm
from ds_ops.op_builder import OpNotCompatibleError, PinMemoryBuilder


def test_compatible_here_without_a_build() -> None:
    builder = PinMemoryBuilder()
    assert builder.NAME == "pin_memory" and bool(builder.is_compatible()) == (os.name == "posix")
    assert builder.prebuilt_installed() is False and builder.build_problems() == []


def test_load_is_immediate_and_gives_the_process_allocator() -> None:
    started = time.perf_counter()
    handle = PinMemoryBuilder().load().pin_handle()
    assert time.perf_counter() - started < 1.0  # no compiler run (DeepSpeed's first load JIT-builds an extension)
    assert handle is ds_comm.locked_host_allocator()


def test_handle_allocates_checks_and_frees() -> None:
    handle = PinMemoryBuilder().load().pin_handle()
    buffer = handle.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.float32))
    try:
        buffer.fill_(2.5)
        assert buffer.shape == (4096,) and float(buffer.sum()) == 2.5 * 4096
        assert handle.is_pinned(buffer) and handle.is_pinned(buffer.narrow(0, 16, 16))
        assert not handle.is_pinned(torch.empty(4096))
    finally:
        assert handle.free_cpu_locked_tensor(buffer) is True
    assert handle.free_cpu_locked_tensor_by_ptr(buffer.data_ptr()) is False


def test_not_posix_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PinMemoryBuilder, "runtime_problems", lambda self: ["needs POSIX mlock (this is Windows)"])
    assert not PinMemoryBuilder().is_compatible()
    with pytest.raises(OpNotCompatibleError, match="op pin_memory cannot run on this machine: needs POSIX mlock"):
        PinMemoryBuilder().load()
