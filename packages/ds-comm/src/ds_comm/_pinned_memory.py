"""A process-wide running total of the host memory pinned through the accelerator.

Pinned (page-locked) memory cannot be swapped out and counts against the memlock limit (`ulimit -l`).
Offload paths pin a lot of it, often in many small shards at init, and a host out-of-memory error
then shows up far from the calls that used the budget. The total is the hint that connects the two.

Every `Accelerator.pin_memory` that really pins adds the tensor's bytes here. At each power-of-two
multiple of 32 GiB the tracker logs one INFO line, so a large offload setup leaves a handful of
milestones in the log rather than one line per shard (those go to DEBUG).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["PinnedMemoryTracker", "pinned_memory_summary", "pinned_memory_tracker", "track_pinned_memory"]

_GIB = 1024**3
#: The first milestone; each one crossed doubles the next.
FIRST_MILESTONE_BYTES = 32 * _GIB


class PinnedMemoryTracker:
    """Bytes and calls of pinning so far, and the next milestone to log.

    The fields keep DeepSpeed's names (`_bytes`, `_calls`, `_next_checkpoint`): its tests and tools
    read them directly. `total_bytes`, `calls` and `next_milestone` are the same values.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything tracked so far."""
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = FIRST_MILESTONE_BYTES

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def next_milestone(self) -> int:
        return self._next_checkpoint

    @staticmethod
    def format_bytes(num_bytes: int) -> str:
        """`512` -> `512 B`, `2048` -> `2.0 KB`, `2**20` -> `1.00 MB`, `2**30` -> `1.000 GB` (DeepSpeed's format)."""
        if num_bytes >= _GIB:
            return f"{num_bytes / _GIB:.3f} GB"
        if num_bytes >= 1024**2:
            return f"{num_bytes / 1024**2:.2f} MB"
        if num_bytes >= 1024:
            return f"{num_bytes / 1024:.1f} KB"
        return f"{num_bytes} B"

    def track(self, num_bytes: int) -> None:
        """Add one pinning of `num_bytes`; log each milestone the total crosses (several at once if need be)."""
        if num_bytes < 0:
            raise ValueError(f"track_pinned_memory: num_bytes must be >= 0, got {num_bytes}")
        self._bytes += num_bytes
        self._calls += 1
        logger.debug(
            "pin_memory: +%s (call #%d, running total: %s)",
            self.format_bytes(num_bytes),
            self._calls,
            self.format_bytes(self._bytes),
        )
        while self._bytes >= self._next_checkpoint:
            logger.info(
                "[pinned-memory checkpoint] crossed %s: %s pinned across %d allocations",
                self.format_bytes(self._next_checkpoint),
                self.format_bytes(self._bytes),
                self._calls,
            )
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        """One INFO line with the total so far (`tag` says where in the run it was taken)."""
        prefix = f"[pinned-memory {tag}]" if tag else "[pinned-memory]"
        logger.info("%s %s pinned across %d allocations", prefix, self.format_bytes(self._bytes), self._calls)


pinned_memory_tracker = PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    """Count `num_bytes` of newly pinned host memory in the process-wide total."""
    pinned_memory_tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the process-wide pinned total."""
    pinned_memory_tracker.log_summary(tag)
