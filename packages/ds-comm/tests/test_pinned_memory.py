"""The pinned-memory tracker: running totals, milestones at 32 GiB doubling, and the CUDA accelerator feeding it."""

from __future__ import annotations

import logging

import pytest
import torch

import ds_comm
from ds_comm import PinnedMemoryTracker

GIB = 1024**3


def test_totals_accumulate_and_reset() -> None:
    tracker = PinnedMemoryTracker()
    tracker.track(100)
    tracker.track(torch.zeros(256, dtype=torch.float32).nbytes)
    assert (tracker.total_bytes, tracker.calls) == (100 + 1024, 2)
    tracker.reset()
    assert (tracker.total_bytes, tracker.calls, tracker.next_milestone) == (0, 0, 32 * GIB)


def test_milestones_double_and_log_once_each(caplog: pytest.LogCaptureFixture) -> None:
    tracker = PinnedMemoryTracker()
    with caplog.at_level(logging.INFO, logger="ds_comm._pinned_memory"):
        tracker.track(31 * GIB)  # below the first milestone
        assert tracker.next_milestone == 32 * GIB
        tracker.track(2 * GIB)  # 33 GiB: crosses 32
        assert tracker.next_milestone == 64 * GIB
        tracker.track(100 * GIB)  # 133 GiB: crosses 64 and 128 in one call
        assert tracker.next_milestone == 256 * GIB
    milestones = [r.getMessage() for r in caplog.records if "checkpoint] crossed" in r.getMessage()]
    assert len(milestones) == 3
    assert "32.000 GB" in milestones[0] and "128.000 GB" in milestones[2]


def test_summary_logs_the_total(caplog: pytest.LogCaptureFixture) -> None:
    tracker = PinnedMemoryTracker()
    tracker.track(3 * 1024**2)
    with caplog.at_level(logging.INFO, logger="ds_comm._pinned_memory"):
        tracker.log_summary("after init")
    assert caplog.records[-1].getMessage() == "[pinned-memory after init] 3.00 MB pinned across 1 allocations"


@pytest.mark.parametrize(
    ("num_bytes", "text"), [(0, "0 B"), (512, "512 B"), (2048, "2.0 KB"), (2**20, "1.00 MB"), (3 * GIB, "3.000 GB")]
)
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert PinnedMemoryTracker.format_bytes(num_bytes) == text


def test_negative_bytes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_bytes must be >= 0"):
        PinnedMemoryTracker().track(-1)


def test_module_functions_use_the_process_tracker() -> None:
    ds_comm.pinned_memory_tracker.reset()
    try:
        ds_comm.track_pinned_memory(4096)
        assert ds_comm.pinned_memory_tracker.total_bytes == 4096
    finally:
        ds_comm.pinned_memory_tracker.reset()


def test_cpu_accelerator_pins_nothing_and_tracks_nothing() -> None:
    from ds_comm.accelerator._cpu import CpuAccelerator

    ds_comm.pinned_memory_tracker.reset()
    tensor = torch.ones(1024)
    assert CpuAccelerator().pin_memory(tensor) is tensor
    assert ds_comm.pinned_memory_tracker.calls == 0
