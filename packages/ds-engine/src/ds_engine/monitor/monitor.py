"""`deepspeed.monitor.monitor.MonitorMaster`: every enabled monitor of a `DeepSpeedMonitorConfig`."""

from __future__ import annotations

from ds_engine._report.monitors import MonitorMaster as _Master
from ds_engine.monitor.comet import CometMonitor
from ds_engine.monitor.config import DeepSpeedMonitorConfig
from ds_engine.monitor.csv_monitor import csvMonitor
from ds_engine.monitor.tensorboard import TensorBoardMonitor
from ds_engine.monitor.wandb import WandbMonitor

__all__ = ["MonitorMaster"]


class MonitorMaster(_Master):
    """Builds the enabled monitors from `monitor_config` (`tb_monitor`, `wandb_monitor`, `csv_monitor`,
    `comet_monitor`; None when disabled) and writes each event list to all of them."""

    def __init__(self, monitor_config: DeepSpeedMonitorConfig) -> None:
        self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard) if monitor_config.tensorboard.enabled else None
        self.wandb_monitor = WandbMonitor(monitor_config.wandb) if monitor_config.wandb.enabled else None
        self.csv_monitor = csvMonitor(monitor_config.csv_monitor) if monitor_config.csv_monitor.enabled else None
        self.comet_monitor = CometMonitor(monitor_config.comet) if monitor_config.comet.enabled else None
        monitors = [m for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor) if m]
        super().__init__(monitors)  # type: ignore[arg-type]
        self.enabled = monitor_config.enabled

    def close(self) -> None:
        """Close the backends that were opened (rank 0)."""
        for monitor in self.monitors:
            backend = getattr(monitor, "_backend", None)
            if backend is not None:
                backend.close()
