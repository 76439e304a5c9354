"""The ds_config: loading, per-section models, the batch triple, "auto" placeholders, cross-field checks."""

from __future__ import annotations

from ds_engine.config._batch import BatchPlan
from ds_engine.config._deepspeed_config import DeepSpeedConfig
from ds_engine.config._errors import DeepSpeedConfigError
from ds_engine.config._pipe_interim import ActivationCheckpointingConfig, PipelineConfig
from ds_engine.config._sections import (
    BF16Config,
    CheckpointConfig,
    CSVMonitorConfig,
    DataTypesConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TimersConfig,
)
from ds_engine.config._toplevel import DeepSpeedConfigModel
from ds_engine.config._zero_section import ZeroSettings

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "BatchPlan",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedConfigModel",
    "FP16Config",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "TimersConfig",
    "ZeroSettings",
]
