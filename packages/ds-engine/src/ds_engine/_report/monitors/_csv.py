"""CSV monitor: one file per event name under `output_path/job_name`, rows `step,value`."""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

__all__ = ["CsvMonitor"]


class CsvMonitor:
    """Appends events to `<output_path>/<job_name>/<event name with '/' as '_'>.csv`.

    Args:
        output_path: directory (empty: the current directory).
        job_name: subdirectory for this run.
    """

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = Path(output_path or os.getcwd()) / job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[IO[str], Any]] = {}

    def _writer(self, name: str) -> Any:
        if name not in self._files:
            path = self.log_dir / (name.replace("/", "_") + ".csv")
            new = not path.exists()
            handle = path.open("a", newline="")
            writer = csv.writer(handle)
            if new:
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            self._files[name] = (handle, writer)
        return self._files[name][1]

    def write_events(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self._writer(name).writerow([step, value])
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()
