"""`deepspeed.utils.pin_memory_tracker`: the process-wide pinned host memory total, which is ds-comm's.

The accelerator's `pin_memory` feeds it; `pinned_memory_summary(tag)` logs the total, and crossing each
power-of-two multiple of 32 GiB logs a milestone. `_tracker` and `_fmt_bytes` are DeepSpeed's names for
the tracker object and its byte formatter.
"""

from __future__ import annotations

from ds_comm import PinnedMemoryTracker, pinned_memory_summary, pinned_memory_tracker, track_pinned_memory

__all__ = ["PinnedMemoryTracker", "pinned_memory_summary", "track_pinned_memory"]

_tracker = pinned_memory_tracker
_fmt_bytes = PinnedMemoryTracker.format_bytes
