"""The pipeline seam: initialize() hands a `ds_pipe.PipelineModule` to a PipelineEngine built here.

[Note: status] Pipeline execution belongs to ds-pipe (schedules, p2p, executor). This module is
where the engine side plugs in: `is_pipeline_module` recognises the model without importing
ds-pipe eagerly, and `build_pipeline_engine` is the single call site initialize() uses. Until the
PipelineEngine lands it raises a clear NotImplementedError instead of training incorrectly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ds_engine._optional import require

if TYPE_CHECKING:
    from ds_engine._plan import AssemblyPlan
    from ds_engine.config import DeepSpeedConfig

__all__ = ["PipelineError", "build_pipeline_engine", "is_pipeline_module"]


class PipelineError(RuntimeError):
    """A call that pipeline mode does not allow (forward/backward/step: use train_batch())."""


def is_pipeline_module(model: nn.Module) -> bool:
    """Whether `model` is a ds_pipe.PipelineModule (checked by class lineage, so ds-pipe is not imported)."""
    return any(cls.__name__ == "PipelineModule" and cls.__module__.startswith("ds_pipe")
               for cls in type(model).__mro__)


def build_pipeline_engine(*, model: nn.Module, config: DeepSpeedConfig, plan: AssemblyPlan,
                          mpu: Any) -> tuple[Any, Any, Any, Any]:
    """The PipelineEngine for a PipelineModule (ZeRO stage < 2, no mpu: the module's grid is used).

    Raises:
        ImportError: ds-pipe is not installed.
        ValueError: DeepSpeed's pipeline preconditions (mpu given, ZeRO stage >= 2).
        NotImplementedError: the PipelineEngine itself is not part of this ds-engine release yet.
    """
    require("ds_pipe", extra="pipe", feature="pipeline parallelism (a PipelineModule)")
    if mpu is not None:
        raise ValueError("initialize(): mpu must be None for a PipelineModule (its topology provides the grid)")
    if plan.zero_stage >= 2:
        raise ValueError(f"zero_optimization.stage={plan.zero_stage}: ZeRO-2 and ZeRO-3 are incompatible with "
                         "pipeline parallelism; use stage 0 or 1")
    raise NotImplementedError("PipelineEngine is not implemented in this ds-engine release: the seam is "
                              "ds_engine/_pipeline.py:build_pipeline_engine, driving ds-pipe's TrainSchedule")
