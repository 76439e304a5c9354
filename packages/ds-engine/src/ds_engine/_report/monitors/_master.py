"""`MonitorMaster`: fans events out to the enabled monitors, on rank 0 only."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ds_engine._report.monitors._comet import CometMonitor, require_comet
from ds_engine._report.monitors._csv import CsvMonitor
from ds_engine._report.monitors._tensorboard import TensorBoardMonitor, tensorboard_available
from ds_engine._report.monitors._wandb import WandbMonitor, require_wandb

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = ["Event", "MonitorMaster", "build_monitor"]

Event = tuple[str, float, int]
"""(name such as "Train/Samples/train_loss", value, global_samples)."""


class _Monitor(Protocol):
    def write_events(self, events: Sequence[Event]) -> None: ...

    def close(self) -> None: ...


class MonitorMaster:
    """The engine's one monitor: writes to every enabled backend (DeepSpeed's `engine.monitor`)."""

    def __init__(self, monitors: list[_Monitor]) -> None:
        self.monitors = monitors
        self.enabled = bool(monitors)

    def write_events(self, events: Sequence[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()


def build_monitor(config: DeepSpeedConfig, *, rank: int) -> MonitorMaster | None:
    """The monitor for the config: None when no monitor is enabled; an empty master on ranks other than 0.

    Raises:
        ImportError: tensorboard, wandb or comet is enabled but its package is not installed (checked
            on every rank, so all ranks fail together instead of rank 0 alone).
    """
    model = config.parsed
    tb, csv_cfg, wb, comet = model.tensorboard, model.csv_monitor, model.wandb, model.comet
    if not (tb.enabled or csv_cfg.enabled or wb.enabled or comet.enabled):
        return None
    if tb.enabled and not tensorboard_available():
        TensorBoardMonitor(tb.output_path, tb.job_name)  # raises the explanatory ImportError
    if wb.enabled:
        require_wandb()
    if comet.enabled:
        require_comet()
    if rank != 0:
        return MonitorMaster([])
    monitors: list[_Monitor] = []
    if tb.enabled:
        monitors.append(TensorBoardMonitor(tb.output_path, tb.job_name))
    if wb.enabled:
        monitors.append(WandbMonitor(wb.project, wb.group, wb.team))
    if csv_cfg.enabled:
        monitors.append(CsvMonitor(csv_cfg.output_path, csv_cfg.job_name))
    if comet.enabled:
        monitors.append(
            CometMonitor(
                samples_log_interval=comet.samples_log_interval,
                project=comet.project,
                workspace=comet.workspace,
                api_key=comet.api_key,
                experiment_name=comet.experiment_name,
                experiment_key=comet.experiment_key,
                online=comet.online,
                mode=comet.mode,
            )
        )
    return MonitorMaster(monitors)
