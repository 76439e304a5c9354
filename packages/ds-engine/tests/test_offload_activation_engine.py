"""The offload engine under `CheckpointHiddenStatesOffload`: layouts, skips, buffer reuse, streams, arguments.

Runs on CPU through `HostAsDevice`, whose streams record the waits asked of them and whose
events finish only when the test says so.
"""

from __future__ import annotations

import pytest
import torch
from host_as_device import HostAsDevice
from torch import nn
from torch.utils.checkpoint import checkpoint

from ds_engine.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload,
    _ActivationOffloadEngine,
)


def _engine(accel: HostAsDevice, **kwargs: object) -> _ActivationOffloadEngine:
    settings: dict = {"use_streams": False, "min_offload_bytes": 0, "keep_last_count": 0, **kwargs}
    return _ActivationOffloadEngine(accelerator=accel, **settings)


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x.sin().square()


def test_view_with_offset_and_gaps_comes_back_with_its_layout() -> None:
    base = torch.randn(7, 10)
    view = base[2:, ::3]
    assert view.storage_offset() > 0 and not view.is_contiguous()
    expected = view.clone()
    engine = _engine(HostAsDevice())
    tensor_id = engine.offload_input(view)
    assert tensor_id is not None
    (copy,) = engine._tracker.values()
    assert copy[0].is_contiguous() and copy[0].shape == view.shape  # dense host buffer
    base.fill_(float("nan"))  # the device original is gone; only the host copy is left
    restored = engine.restore_input(tensor_id)
    assert restored.shape == view.shape and restored.stride() == view.stride()
    assert restored.storage_offset() == 0
    torch.testing.assert_close(restored, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 8).expand(3, 4, 8),  # stride 0
        lambda: torch.randn(20).as_strided((4, 4), (2, 1)),  # rows overlap
        lambda: nn.Parameter(torch.randn(4, 8)),
    ],
    ids=["expanded", "overlapping-rows", "parameter"],
)
def test_unsafe_or_persistent_tensors_stay(make) -> None:
    engine = _engine(HostAsDevice())
    assert engine.offload_input(make()) is None
    assert engine.stats.skipped_marked_tensors == 1 and not engine._tracker


def test_small_tensors_stay_and_large_ones_move() -> None:
    engine = _engine(HostAsDevice(), min_offload_bytes=4 * 32)
    assert engine.offload_input(torch.randn(31)) is None
    assert engine.offload_input(torch.randn(32)) is not None
    assert engine.stats.offloaded_tensors == 1 and engine.stats.offloaded_bytes == 4 * 32


def test_keep_last_window_holds_the_newest() -> None:
    engine = _engine(HostAsDevice(), keep_last_count=2)
    tensors = [torch.randn(4, 4) for _ in range(5)]
    ids = [engine.offload_input(t) for t in tensors]
    assert list(engine._keep_last) == ids[-2:]
    assert all(engine._keep_last[i] is t for i, t in zip(ids[-2:], tensors[-2:], strict=True))
    assert sorted(engine._tracker) == ids[:3]
    assert engine.restore_input(ids[-1]) is tensors[-1]  # never left
    restored = engine.restore_input(ids[0])
    assert restored is not tensors[0] and torch.equal(restored, tensors[0])
    assert engine.stats.kept_last_tensors == 1 and engine.stats.restored_tensors == 1


def _run_marked(offload: CheckpointHiddenStatesOffload, x: torch.Tensor, layers: nn.ModuleList) -> torch.Tensor:
    h = x
    for layer in layers:
        offload.mark(h)
        h = checkpoint(layer, h, use_reentrant=False)
    return h.square().sum()


def test_host_buffers_are_reused_across_steps_unless_the_pool_is_empty() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
    x = torch.randn(8, 16, requires_grad=True)
    for pool_count, expected_allocs in ((64, 3), (0, 6)):
        accel = HostAsDevice()
        offload = CheckpointHiddenStatesOffload(
            use_streams=False, min_offload_bytes=0, max_cpu_buffer_pool_count=pool_count, accelerator=accel
        )
        for _ in range(2):
            with offload:
                _run_marked(offload, x, layers).backward()
        assert len(accel.pinned) == expected_allocs  # keep_last=1: three inputs move per step
        assert offload._cpu_buffer_pool_count == min(pool_count, 3)


def test_buffer_key_ignores_strides_and_follows_pinning() -> None:
    accel = HostAsDevice()
    dense, strided = torch.randn(6, 4), torch.randn(6, 8)[:, ::2]
    assert _engine(accel)._buffer_key(dense) == _engine(accel)._buffer_key(strided)
    assert _engine(accel)._buffer_key(dense) != _engine(accel, use_pin_memory=False)._buffer_key(dense)


@pytest.mark.parametrize("use_pin_memory", [True, False])
def test_pinning_goes_through_the_accelerator(use_pin_memory: bool) -> None:
    accel = HostAsDevice()
    engine = _engine(accel, use_pin_memory=use_pin_memory)
    engine.offload_input(torch.randn(4, 8))
    (copy,) = engine._tracker.values()
    assert accel.is_pinned(copy[0]) is use_pin_memory


def test_host_buffer_waits_for_its_copy_back_before_reuse() -> None:
    accel = HostAsDevice()
    engine = _engine(accel, use_streams=True, max_fwd_stash_count=0)
    (side,) = accel.side_streams
    first = engine.offload_input(torch.randn(4, 8))
    assert first is not None
    (copy,) = engine._tracker.values()
    side.hold_events = True
    engine.restore_input(first)
    copied_back = side.events[-1]
    assert accel.compute.waited_events == [copied_back]  # compute waits for the copy back
    assert engine._cpu_buffer_pool_count == 0  # the copy back may still read the buffer
    engine.offload_input(torch.randn(4, 8))
    assert engine._tracker[2][0] is not copy[0]
    copied_back.synchronize()
    engine.offload_input(torch.randn(4, 8))
    assert engine._tracker[3][0] is copy[0]


def test_stashed_source_is_returned_without_a_copy() -> None:
    accel = HostAsDevice()
    engine = _engine(accel, use_streams=True, max_fwd_stash_count=2)
    tensors = [torch.randn(4, 8) for _ in range(4)]
    ids = [engine.offload_input(t) for t in tensors]
    assert sorted(engine._fwd_stash) == ids[-2:]  # older sources were let go
    assert engine.restore_input(ids[-1]) is tensors[-1]
    assert accel.compute.waited_events[-1] is engine.s1.events[-1]  # its offload's event
    restored = engine.restore_input(ids[0])
    assert restored is not tensors[0] and torch.equal(restored, tensors[0])


def test_zero_stash_keeps_no_source() -> None:
    engine = _engine(HostAsDevice(), use_streams=True, max_fwd_stash_count=0)
    for _ in range(3):
        engine.offload_input(torch.randn(4, 8))
    assert not engine._fwd_stash and len(engine._tracker) == 3


def test_retain_graph_restores_once() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(
        use_streams=False, min_offload_bytes=0, keep_last_count=0, accelerator=HostAsDevice()
    )
    with offload:
        offload.mark(x)
        loss = _fn(checkpoint(_fn, x, use_reentrant=False)).sum()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        x.grad = None
        loss.backward()
    assert offload.stats.restored_tensors == 1
    torch.testing.assert_close(x.grad, first, rtol=0, atol=0)


def test_restore_after_reset_names_the_problem() -> None:
    engine = _engine(HostAsDevice())
    tensor_id = engine.offload_input(torch.randn(4, 8))
    assert tensor_id is not None
    engine.reset()
    with pytest.raises(RuntimeError, match=f"offloaded activation {tensor_id} is not tracked"):
        engine.restore_input(tensor_id)


@pytest.mark.parametrize(
    "name", ["keep_last_count", "max_fwd_stash_count", "max_cpu_buffer_pool_count", "min_offload_bytes"]
)
def test_negative_settings_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be >= 0, got -1"):
        CheckpointHiddenStatesOffload(**{name: -1})


@pytest.mark.parametrize(
    ("size", "stride", "overlaps"),
    [
        ((4, 8), (8, 1), False),
        ((8, 4), (1, 8), False),  # transposed
        ((5, 4), (10, 3), False),  # gaps
        ((3, 1, 4), (4, 99, 1), False),  # size-1 dims do not count
        ((2, 4, 8), (0, 8, 1), True),  # expanded
        ((4, 4), (2, 1), True),  # windows sharing elements
        ((3, 3), (3, 3), True),
    ],
)
def test_overlap_detection(size: tuple, stride: tuple, overlaps: bool) -> None:
    from ds_engine._activation_offload.offload_engine import _elements_overlap

    tensor = torch.zeros(200).as_strided(size, stride)
    assert _elements_overlap(tensor) is overlaps
