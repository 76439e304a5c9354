"""The pipeline seam: initialize() hands a `ds_pipe.PipelineModule` to a `PipelineEngine` built here.

`is_pipeline_module` recognises the model without importing ds-pipe eagerly;
`check_pipeline_call` runs DeepSpeed's preconditions before anything is built (so initialize()
can then take the data-parallel layout from the module's grid); `build_pipeline_engine` applies
the `pipeline` and `activation_checkpointing` sections (validated by ds-pipe's own models when the
config was read), carries out the ordinary assembly with the grid as the mpu, and wraps it in a `PipelineEngine`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from ds_engine._engine.assembly import AssemblyInputs, assemble
from ds_engine._optional import require
from ds_engine._pipeline.engine import PipelineEngine, PipelineError, PipelineSettings
from ds_engine.config import DeepSpeedConfigError

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = ["PipelineError", "build_pipeline_engine", "check_pipeline_call", "is_pipeline_module"]


def is_pipeline_module(model: nn.Module) -> bool:
    """Whether `model` is a ds_pipe.PipelineModule (checked by class lineage, so ds-pipe is not imported)."""
    return any(cls.__name__ == "PipelineModule" and cls.__module__.startswith("ds_pipe") for cls in type(model).__mro__)


def check_pipeline_call(mpu: Any) -> None:
    """DeepSpeed's argument rules for a PipelineModule, checked before the grid is used.

    Raises:
        ImportError: ds-pipe is not installed.
        ValueError: an mpu was passed (the module's topology provides the grid).
    """
    require("ds_pipe", extra="pipe", feature="pipeline parallelism (a PipelineModule)")
    if mpu is not None:
        raise ValueError("initialize(): mpu must be None for a PipelineModule (its topology provides the grid)")


def _pipeline_sections(model: nn.Module, config: DeepSpeedConfig) -> tuple[Any, Any]:
    """Apply what applies here of `pipeline` / `activation_checkpointing` (validated by `DeepSpeedConfig`)."""
    ds_pipe = require("ds_pipe", extra="pipe", feature="pipeline parallelism (a PipelineModule)")
    raw = config.raw
    section = config.pipeline
    stages = model.num_pipeline_stages()
    if section.stages != "auto" and section.stages != stages:
        raise DeepSpeedConfigError(
            f"pipeline.stages={section.stages} but the PipelineModule was built with {stages} "
            'stages; set "auto" or match PipelineModule(num_stages=...)'
        )
    given = raw.get("pipeline", {})
    if not section.use_reentrant:  # whatever the interval: set_checkpoint_interval() may turn it on later
        model.activation_checkpoint_func = ds_pipe.checkpointing.non_reentrant_checkpoint
    if section.activation_checkpoint_interval > 0:
        model.set_checkpoint_interval(section.activation_checkpoint_interval)
    if "partition" in given and section.partition != "best":
        logger.warning(
            "pipeline.partition=%r has no effect: the PipelineModule is partitioned when it is built; "
            "pass partition_method=%r to PipelineModule",
            section.partition,
            section.partition,
        )
    if given.get("seed_layers") and not model.seed_layers:
        logger.warning(
            "pipeline.seed_layers=true has no effect: layers are built before initialize(); pass "
            "seed_layers=True to PipelineModule"
        )
    ckpt = None
    if "activation_checkpointing" in raw:
        ckpt = config.activation_checkpointing
        ds_pipe.checkpointing.configure(model.mpu(), deepspeed_config=ckpt)
    return section, ckpt


def build_pipeline_engine(inputs: AssemblyInputs) -> tuple[PipelineEngine, Any, Any, Any]:
    """The PipelineEngine for a PipelineModule (ZeRO stage < 2; `dist` from the module's grid).

    Returns:
        `(engine, optimizer, training_dataloader, lr_scheduler)` as initialize() does.

    Raises:
        ImportError: ds-pipe is not installed.
        DeepSpeedConfigError: ZeRO stage >= 2, a bad `pipeline` / `activation_checkpointing` section,
            `pipeline.stages` disagreeing with the module.
    """
    model, config, plan = inputs.module, inputs.config, inputs.plan
    if plan.zero_stage >= 2:
        raise DeepSpeedConfigError(
            f"zero_optimization.stage={plan.zero_stage}: ZeRO-2 and ZeRO-3 are incompatible "
            "with pipeline parallelism; use stage 0 or 1"
        )
    section, _ = _pipeline_sections(model, config)
    # Clipping must see every stage, so the stepper is built without it and the engine clips (see _pipeline.clip).
    stepper_plan = dataclasses.replace(plan, clip=0.0)
    # DeepSpeed's PipelineEngine reads `training_data` in order (a DistributedSampler without shuffle).
    parts = assemble(dataclasses.replace(inputs, plan=stepper_plan, shuffle_training_data=False))
    parts.plan = plan
    # Every stepper skips on inf/nan exactly when plan.check_overflow says so (ds_ops.precision.finish_step).
    skips = plan.check_overflow
    settings = PipelineSettings(
        pipe_partitioned=section.pipe_partitioned,
        grad_partitioned=section.grad_partitioned,
        clip=plan.clip,
        input_dtype=None if plan.precision == "fp32" else plan.dtype,
        scale_loss=plan.precision == "fp16",
        agree_overflow=skips,
    )
    engine = PipelineEngine(parts, settings)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
