"""`deepspeed.monitor`: DeepSpeed's monitor classes, each built from its config section.

`monitor.config.DeepSpeedMonitorConfig` holds the four sections (`tensorboard`, `wandb`, `csv_monitor`,
`comet`; also `DeepSpeedConfig.monitor_config`). `TensorBoardMonitor(section)`, `WandbMonitor(section)`,
`csvMonitor(section)` and `CometMonitor(section)` expose the section's settings as attributes and, when
enabled, write on global rank 0 through ds's backends (`ds_engine._report.monitors`);
`monitor.MonitorMaster(monitor_config)` fans events out to the enabled ones, as the engine's monitor does.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["comet", "config", "csv_monitor", "monitor", "tensorboard", "wandb"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"ds_engine.monitor.{name}")
    raise AttributeError(f"module 'ds_engine.monitor' has no attribute {name!r}")
