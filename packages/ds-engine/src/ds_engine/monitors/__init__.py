"""Training-event monitors (CSV, TensorBoard): rank 0 writes `(name, value, global_samples)` events."""

from __future__ import annotations

from ds_engine.monitors._csv import CsvMonitor
from ds_engine.monitors._master import Event, MonitorMaster, build_monitor
from ds_engine.monitors._tensorboard import TensorBoardMonitor, tensorboard_available

__all__ = ["CsvMonitor", "Event", "MonitorMaster", "TensorBoardMonitor", "build_monitor", "tensorboard_available"]
