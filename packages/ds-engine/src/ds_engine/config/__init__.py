"""The ds_config: loading, per-section models, the batch triple, "auto" placeholders, cross-field checks.

The section models are pydantic models, and pydantic alone costs ~0.3 s to import; so the names
below load their submodule on first access (`from ds_engine.config import DeepSpeedConfig` works as
usual) and `import ds_engine` stays cheap. `DeepSpeedConfigError` needs no pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_engine.config._errors import DeepSpeedConfigError
from ds_engine.config._layout_default import default_checkpoint_layout, set_default_checkpoint_layout

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from ds_engine.config._batch import BatchPlan
    from ds_engine.config._deepspeed_config import DeepSpeedConfig
    from ds_engine.config._hybrid_engine import HybridEngineConfig
    from ds_engine.config._sections import (
        BF16Config,
        CheckpointConfig,
        CheckpointWriterConfig,
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
    from ds_pipe import ActivationCheckpointingConfig, PipelineConfig

#: public name -> the submodule that defines it
_WHERE = {
    "BF16Config": "_sections",
    "BatchPlan": "_batch",
    "CSVMonitorConfig": "_sections",
    "CheckpointConfig": "_sections",
    "CheckpointWriterConfig": "_sections",
    "DataTypesConfig": "_sections",
    "DeepSpeedConfig": "_deepspeed_config",
    "DeepSpeedConfigModel": "_toplevel",
    "FP16Config": "_sections",
    "HybridEngineConfig": "_hybrid_engine",
    "OptimizerConfig": "_sections",
    "SchedulerConfig": "_sections",
    "TensorBoardConfig": "_sections",
    "TimersConfig": "_sections",
    "ZeroSettings": "_zero_section",
}

#: ds-pipe's section models, served under their DeepSpeed-era names here (the `pipe` extra)
_FROM_DS_PIPE = {"ActivationCheckpointingConfig": "activation_checkpointing", "PipelineConfig": "pipeline"}


def __getattr__(name: str) -> object:
    if name in _FROM_DS_PIPE:
        sections = importlib.import_module("ds_engine.config._pipe_sections")
        return sections.pipe_section_model(_FROM_DS_PIPE[name])
    if name in _WHERE:
        return getattr(importlib.import_module(f"ds_engine.config.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'ds_engine.config' has no attribute {name!r}")


__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "BatchPlan",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CheckpointWriterConfig",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedConfigModel",
    "FP16Config",
    "HybridEngineConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "TimersConfig",
    "ZeroSettings",
    "default_checkpoint_layout",
    "set_default_checkpoint_layout",
]
