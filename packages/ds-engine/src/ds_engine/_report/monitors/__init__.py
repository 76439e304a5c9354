"""Training-event monitors (CSV, TensorBoard, wandb, Comet): rank 0 writes `(name, value, global_samples)` events."""

from __future__ import annotations

from ds_engine._report.monitors._comet import CometMonitor, comet_available
from ds_engine._report.monitors._csv import CsvMonitor
from ds_engine._report.monitors._master import Event, MonitorMaster, build_monitor
from ds_engine._report.monitors._tensorboard import TensorBoardMonitor, tensorboard_available
from ds_engine._report.monitors._wandb import WandbMonitor, wandb_available

__all__ = [
    "CometMonitor",
    "CsvMonitor",
    "Event",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
    "build_monitor",
    "comet_available",
    "tensorboard_available",
    "wandb_available",
]
