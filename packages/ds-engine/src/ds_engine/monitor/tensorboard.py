"""`deepspeed.monitor.tensorboard.TensorBoardMonitor`: built from the `tensorboard` section."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ds_engine._report.monitors import TensorBoardMonitor as _Backend
from ds_engine.monitor._rank import is_rank_zero

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor:
    """`enabled`, `output_path` and `job_name` from the section; a `SummaryWriter` on rank 0 when enabled.

    Raises:
        ImportError: enabled without the tensorboard package (on rank 0, where the writer is made).
    """

    def __init__(self, tensorboard_config: Any) -> None:
        self.enabled = tensorboard_config.enabled
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self._backend = _Backend(self.output_path, self.job_name) if self.enabled and is_rank_zero() else None
        self.summary_writer = self._backend.writer if self._backend is not None else None

    def write_events(self, event_list: Sequence[tuple[str, float, int]], flush: bool = True) -> None:
        """Add each `(name, value, step)` as a scalar (the writer flushes after each list)."""
        if self._backend is not None:
            self._backend.write_events(event_list)

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()
