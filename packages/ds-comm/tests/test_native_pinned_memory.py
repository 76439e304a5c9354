"""The native pinned-memory backend: page-locked buffers, their lifetimes (unpin, last view gone), views
counted as pinned, device registration through a registrar, and the DS_PIN_MEMORY_BACKEND switch."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

import ds_comm
from ds_comm import native_pinned_memory as npm


@pytest.fixture
def pins() -> npm.NativePinnedMemory:
    return npm.NativePinnedMemory()


@pytest.fixture(autouse=True)
def _fresh_shared_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npm, "_shared_native_pins", None)
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    monkeypatch.delenv("DS_PIN_MEMORY_REGISTER_DEVICE", raising=False)


def _live_regions() -> int:
    return ds_comm.locked_host_allocator().num_regions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_pin_copies_values_and_shape(pins: npm.NativePinnedMemory, dtype: torch.dtype) -> None:
    src = (torch.arange(24) % 5).to(dtype).reshape(2, 3, 4)
    pinned = pins.pin(src)
    assert pinned.shape == src.shape and pinned.dtype == dtype and pinned.device.type == "cpu"
    assert torch.equal(pinned, src)
    assert pinned.data_ptr() != src.data_ptr()
    assert pinned.data_ptr() % mmap.PAGESIZE == 0  # page-aligned, as mlock works in pages
    assert pinned.ds_pinned is True and pinned.ds_pin_base == pinned.data_ptr()
    src.zero_()
    assert pinned.sum() != 0  # a copy, not a view of the source


def test_make_copy_and_match_shape_flags(pins: npm.NativePinnedMemory) -> None:
    src = torch.ones(3, 5)
    flat = pins.pin(src, match_shape=False)
    assert flat.shape == (15,) and torch.equal(flat, torch.ones(15))
    scratch = pins.pin(src, make_copy=False)
    assert scratch.shape == (3, 5) and pins.is_pinned(scratch)
    empty = pins.pin_empty(torch.empty(0, dtype=torch.float16), (4, 2))
    assert empty.shape == (4, 2) and empty.dtype == torch.float16 and pins.is_pinned(empty)


def test_views_are_pinned_and_foreign_tensors_are_not(pins: npm.NativePinnedMemory) -> None:
    pinned = pins.pin(torch.arange(40.0).reshape(5, 8))
    view = pinned.reshape(-1)[10:20]
    assert not hasattr(view, "ds_pinned")
    assert pins.is_pinned(view) and pins.is_pinned(pinned[4]) and pins.is_pinned(pinned.t())
    assert not pins.is_pinned(torch.arange(40.0))
    assert not pins.is_pinned(pinned.clone())


def test_unpin_frees_now_and_views_stop_counting(pins: npm.NativePinnedMemory) -> None:
    before = _live_regions()
    pinned = pins.pin(torch.arange(16.0))
    view = pinned[4:8]
    assert _live_regions() == before + 1 and len(pins._ranges) == 1
    assert pins.unpin(pinned) is True
    assert _live_regions() == before and pins._ranges == {}
    assert pinned.ds_pinned is False
    assert not pins.is_pinned(pinned) and not pins.is_pinned(view)
    assert pins.unpin(pinned) is False  # a second unpin finds nothing
    del view, pinned
    gc.collect()
    assert _live_regions() == before  # the detached finalizer did not free twice


def test_buffer_is_freed_when_its_last_view_dies(pins: npm.NativePinnedMemory) -> None:
    before = _live_regions()
    pinned = pins.pin(torch.arange(32.0))
    base = pinned.data_ptr()
    view = pinned.narrow(0, 8, 8)
    del pinned
    gc.collect()
    assert base in pins._ranges and pins.is_pinned(view)
    assert view.tolist() == [float(v) for v in range(8, 16)]  # the memory is still there
    del view
    gc.collect()
    assert base not in pins._ranges and _live_regions() == before


def test_unpin_after_data_swap_frees_the_original(pins: npm.NativePinnedMemory) -> None:
    pinned = pins.pin(torch.arange(8.0))
    base = pinned.data_ptr()
    keep = pinned[:2]  # the allocation stays alive through this view until unpin
    pinned.data = torch.zeros(8)
    assert pins.unpin(pinned) is True
    assert base not in pins._ranges
    del keep


def test_storageless_tensors_are_not_pinned(pins: npm.NativePinnedMemory) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        assert pins.is_pinned(mode.from_tensor(torch.zeros(4))) is False
    assert pins.is_pinned(torch.zeros(4, device="meta")) is False


class _Registrar:
    """A device runtime that needs 4 KiB-aligned ranges and records what it is asked."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        self.registered.append((address, num_bytes))
        return self.accept

    def unregister_host_memory(self, address: int) -> None:
        self.unregistered.append(address)

    def pin_memory_alignment(self) -> int:
        return 4096


def test_registrar_sees_each_buffer_once_and_unpin_unregisters(pins: npm.NativePinnedMemory) -> None:
    runtime = _Registrar()
    pinned = pins.pin(torch.ones(10), registrar=runtime)
    base = pinned.data_ptr()
    start, num_bytes = runtime.registered[0]
    assert start % 4096 == 0 and start <= base and start + num_bytes >= base + 40
    pins.unpin(pinned)
    assert runtime.unregistered == [start]


def test_garbage_collection_unregisters_too(pins: npm.NativePinnedMemory) -> None:
    runtime = _Registrar()
    pinned = pins.pin(torch.ones(10), registrar=runtime)
    del pinned
    gc.collect()
    assert len(runtime.unregistered) == 1 and pins._ranges == {}


def test_refused_or_disabled_registration_leaves_mlock_only(
    pins: npm.NativePinnedMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = _Registrar(accept=False)
    pinned = pins.pin(torch.ones(4), registrar=refusing)
    assert pins.unpin(pinned) is True and refusing.unregistered == []
    monkeypatch.setenv("DS_PIN_MEMORY_REGISTER_DEVICE", "off")
    runtime = _Registrar()
    pins.unpin(pins.pin(torch.ones(4), registrar=runtime))
    assert runtime.registered == []
    monkeypatch.setenv("DS_PIN_MEMORY_REGISTER_DEVICE", "maybe")
    with pytest.raises(ValueError, match="DS_PIN_MEMORY_REGISTER_DEVICE='maybe'"):
        pins.pin(torch.ones(4), registrar=runtime)


def test_backend_switch_reads_the_variable_on_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    assert npm.get_active_native_pinned_memory() is None
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", " Native ")
    shared = npm.get_active_native_pinned_memory()
    assert isinstance(shared, npm.NativePinnedMemory) and npm.get_active_native_pinned_memory() is shared
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "torch")
    assert npm.get_active_native_pinned_memory() is None
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DS_PIN_MEMORY_BACKEND='cuda'.*'torch' or 'native'"):
        npm.get_active_native_pinned_memory()


def test_an_allocator_that_cannot_load_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> npm.PinHandle:
        raise OSError("no such library")

    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    npm.set_pin_handle_loader(broken)
    try:
        with pytest.raises(RuntimeError, match="native needs the pin_memory op.*no such library"):
            npm.get_active_native_pinned_memory()
    finally:
        npm.set_pin_handle_loader(None)
    assert npm.get_active_native_pinned_memory() is not None  # the default allocator again


def test_empty_tensors_need_no_lock(pins: npm.NativePinnedMemory) -> None:
    empty = pins.pin(torch.empty(0, 3))
    assert empty.shape == (0, 3) and pins.is_pinned(empty) and pins._ranges == {}
    assert pins.unpin(empty) is False and not pins.is_pinned(empty)
