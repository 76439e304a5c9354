"""`deepspeed.monitor.config`: the four monitor sections of a config as one model."""

from __future__ import annotations

from typing import Any

from ds_comm import ConfigModel
from ds_engine.config._sections import CometConfig, CSVMonitorConfig, TensorBoardConfig, WandbConfig

__all__ = ["DeepSpeedMonitorConfig", "get_monitor_config"]

_SECTIONS = ("tensorboard", "comet", "wandb", "csv_monitor")


class DeepSpeedMonitorConfig(ConfigModel):
    """`tensorboard`, `comet`, `wandb` and `csv_monitor`, each validated by its section model."""

    tensorboard: TensorBoardConfig = TensorBoardConfig()
    """TensorBoard scalars."""
    comet: CometConfig = CometConfig()
    """Comet experiment."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases run."""
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    """One CSV file per event."""

    @property
    def enabled(self) -> bool:
        """Whether any monitor is enabled."""
        return any(getattr(self, name).enabled for name in _SECTIONS)


def get_monitor_config(param_dict: dict[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor sections of a whole config dict (absent ones at their defaults).

    Raises:
        ds_comm.ConfigError: a section is invalid (the message names the key path).
    """
    from ds_comm import validate_section

    return validate_section(DeepSpeedMonitorConfig, {k: param_dict[k] for k in _SECTIONS if k in param_dict}, path="")
