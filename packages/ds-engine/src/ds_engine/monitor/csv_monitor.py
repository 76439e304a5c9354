"""`deepspeed.monitor.csv_monitor.csvMonitor`: built from the `csv_monitor` section."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ds_engine._report.monitors import CsvMonitor as _Backend
from ds_engine.monitor._rank import is_rank_zero

__all__ = ["csvMonitor"]


class csvMonitor:  # noqa: N801 - DeepSpeed's class name
    """`enabled`, `output_path` and `job_name` from the section; on rank 0 when enabled, one CSV per event name."""

    def __init__(self, csv_config: Any) -> None:
        self.enabled = csv_config.enabled
        self.output_path = csv_config.output_path
        self.job_name = csv_config.job_name
        self._backend = _Backend(self.output_path, self.job_name) if self.enabled and is_rank_zero() else None
        self.log_dir = str(self._backend.log_dir) if self._backend is not None else None

    def write_events(self, event_list: Sequence[tuple[str, float, int]]) -> None:
        """Append each `(name, value, step)` as a row of the name's CSV file."""
        if self._backend is not None:
            self._backend.write_events(event_list)
