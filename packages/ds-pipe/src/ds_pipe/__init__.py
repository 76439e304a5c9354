"""ds-pipe: pipeline parallelism usable with no engine.

Topologies and the process grid, `PipelineModule` with `LayerSpec`/`TiedLayerSpec` and partition
methods, 1F1B and inference schedules as instruction streams (`ds_pipe.schedule`), point-to-point
activation transfer, the `PipelineExecutor` that runs them, activation checkpointing
(`ds_pipe.checkpointing`), and the `pipeline` / `activation_checkpointing` config models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_pipe import checkpointing, schedule
from ds_pipe.__about__ import __version__
from ds_pipe._executor import PipelineError, PipelineExecutor
from ds_pipe._grid import PipelineParallelGrid
from ds_pipe._layer_io import CheckpointEngine
from ds_pipe._layer_spec import LayerSpec, TiedLayerSpec
from ds_pipe._module import PartitionMethodError, PipelineModule
from ds_pipe._p2p import ActivationShapeError
from ds_pipe._partition import partition_balanced, partition_uniform, prefix_sum_inc
from ds_pipe._partitioned_tensor import PartitionedTensor
from ds_pipe._topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from ds_pipe.schedule import DataParallelSchedule, InferenceSchedule, PipeSchedule, TrainSchedule

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from ds_pipe.config import ActivationCheckpointingConfig, PipelineConfig


def __getattr__(name: str) -> object:
    # The config models import pydantic (~0.3 s); they load when first asked for.
    if name in ("ActivationCheckpointingConfig", "PipelineConfig"):
        return getattr(importlib.import_module("ds_pipe.config"), name)
    raise AttributeError(f"module 'ds_pipe' has no attribute {name!r}")


__all__ = [
    "ActivationCheckpointingConfig",
    "ActivationShapeError",
    "CheckpointEngine",
    "DataParallelSchedule",
    "InferenceSchedule",
    "LayerSpec",
    "PartitionMethodError",
    "PartitionedTensor",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipeSchedule",
    "PipelineConfig",
    "PipelineError",
    "PipelineExecutor",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
    "TrainSchedule",
    "__version__",
    "checkpointing",
    "partition_balanced",
    "partition_uniform",
    "prefix_sum_inc",
    "schedule",
]
