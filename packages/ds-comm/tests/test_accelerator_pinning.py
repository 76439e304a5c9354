"""The accelerator's pinning API: the torch backend on the CPU accelerator (a no-op) and the native one
(real page-locked buffers), and the pinned-bytes total each of them feeds."""

from __future__ import annotations

import pytest
import torch

import ds_comm
from ds_comm import accelerator as acc
from ds_comm import native_pinned_memory as npm


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> acc.CpuAccelerator:
    monkeypatch.setattr(npm, "_shared_native_pins", None)
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    ds_comm.pinned_memory_tracker.reset()
    return acc.CpuAccelerator()


def test_torch_backend_on_cpu_leaves_tensors_alone(cpu: acc.CpuAccelerator) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    assert cpu.pin_memory(t) is t
    assert cpu.pin_memory(t, match_shape=False).shape == (6,)
    assert not cpu.is_pinned(t) and cpu.unpin_memory(t) is None
    assert cpu.pins_host_memory() is False
    scratch = cpu.pin_empty(2, 5, dtype=torch.int32)
    assert scratch.shape == (2, 5) and scratch.dtype == torch.int32
    assert ds_comm.pinned_memory_tracker.total_bytes == 0  # nothing was locked, nothing is counted


def test_native_backend_really_pins(cpu: acc.CpuAccelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    assert cpu.pins_host_memory() is True
    t = torch.arange(12.0).reshape(3, 4)
    pinned = cpu.pin_memory(t)
    assert pinned is not t and torch.equal(pinned, t) and cpu.is_pinned(pinned[1:])
    flat = cpu.pin_memory(t, match_shape=False)
    scratch = cpu.pin_memory(t, make_copy=False)
    assert flat.shape == (12,) and torch.equal(flat, t.reshape(-1)) and scratch.shape == (3, 4)
    like = cpu.pin_empty_like(t, dtype=torch.bfloat16)
    sized = cpu.pin_empty((2, 2), dtype=torch.float16)
    assert like.shape == (3, 4) and like.dtype == torch.bfloat16 and sized.shape == (2, 2)
    assert all(cpu.is_pinned(x) for x in (flat, scratch, like, sized))
    expected = 3 * t.nbytes + like.nbytes + sized.nbytes
    assert ds_comm.pinned_memory_tracker.total_bytes == expected
    shared = npm.get_active_native_pinned_memory()
    assert shared is not None and len(shared._ranges) == 5
    assert cpu.unpin_memory(pinned) is True and not cpu.is_pinned(pinned)
    assert len(shared._ranges) == 4


def test_native_and_torch_answers_differ_only_where_native_pinned(
    cpu: acc.CpuAccelerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    pinned = cpu.pin_memory(torch.ones(4))
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "torch")
    # With the torch backend the accelerator asks torch only; the native buffer stays allocated.
    assert cpu.is_pinned(pinned) is False and cpu.unpin_memory(pinned) is None
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    assert cpu.unpin_memory(pinned) is True


@pytest.mark.parametrize("device", ["cuda", "meta", "not-a-device"])
def test_pin_empty_is_host_memory_only(cpu: acc.CpuAccelerator, device: str) -> None:
    with pytest.raises(ValueError, match=f"pin_empty: device must be 'cpu'.*{device!r}"):
        cpu.pin_empty(4, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="pin_empty_like: device must be 'cpu'"):
        cpu.pin_empty_like(torch.ones(2), device=device)


def test_meta_tensors_are_never_pinned(cpu: acc.CpuAccelerator, monkeypatch: pytest.MonkeyPatch) -> None:
    meta = torch.empty(3, device="meta")
    assert cpu.is_pinned(meta) is False
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    assert cpu.is_pinned(meta) is False


def test_fp64_support() -> None:
    assert acc.CpuAccelerator().is_fp64_supported() is True
    assert acc.CudaAccelerator().is_fp64_supported() is True
