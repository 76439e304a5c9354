"""Loading a universal checkpoint into a PipelineEngine, at any stage count and data-parallel degree.

A universal checkpoint (`ds_to_universal`'s output, of a pipeline or of a plain model) holds every
parameter whole under `zero/<name>/` (`fp32.pt` and one file per optimizer state), named as the
module names it; a `PipelineModule` names its layers by global index (`2.weight`), whatever the stage
count, so each stage reads exactly its own parameters. As in DeepSpeed 0.19.8:

* the weights come from `fp32.pt` (cast to the module's dtype), not from layer files (a universal
  checkpoint has none); buffers keep their values;
* the optimizer state of this stage's parameters is re-partitioned over this stage's data-parallel
  ranks (ds-zero loads the universal checkpoint as a one-rank ZeRO save);
* counters, lr scheduler and client state come from the model-states file of stage
  `stage_id * num_files // num_stages` (the copied `mp_rank_XX` files of the converted checkpoint).

ZeRO stage 1 is needed (a universal checkpoint's optimizer state only loads into a ZeRO optimizer,
and DeepSpeed's pipeline takes no other stage).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_engine._checkpoint import checkpoint as _checkpoint
from ds_engine._checkpoint.checkpointer import Checkpointer
from ds_engine._optional import require
from ds_engine._step.steppers import ZeroStepper

logger = logging.getLogger(__name__)

__all__ = ["load_pipeline_universal"]


def _stage_state(ckpt_dir: Path, *, stage_id: int, num_stages: int) -> tuple[Path, dict[str, Any]]:
    """The model-states file DeepSpeed reads for this stage: its share of the saved stages' files."""
    files = sorted(ckpt_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(
            f"load_checkpoint: {ckpt_dir} holds no mp_rank_XX_model_states.pt; is it a universal checkpoint "
            "folder (ds_to_universal's --output_folder)?"
        )
    path = files[stage_id * len(files) // num_stages]
    state = ds_comm.load_checkpoint_file(path)
    ds_comm.check_deepspeed_version(state.get("ds_version"), path)
    return path, state


def _read_weights(
    stepper: ZeroStepper, module: torch.nn.Module, ckpt_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """This stage's parameters as a one-rank ZeRO partition, and their full fp32 values by name."""
    ds_zero = require("ds_zero", extra="zero", feature="loading a universal checkpoint")
    shapes = ds_zero.zero_param_shapes(stepper.optimizer, module)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    parts = ds_zero.load_universal_partitions(ckpt_dir, param_shapes=shapes, model_dtype=dtype)
    return parts, ds_zero.consolidate_fp32_params(parts)


def load_pipeline_universal(
    checkpointer: Checkpointer,
    load_dir: str | Path,
    tag: Any,
    *,
    stage_id: int,
    num_stages: int,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str | None, dict[str, Any] | None]:
    """See `PipelineEngine.load_checkpoint` with `checkpoint.load_universal` (module docstring).

    Everything is read before the engine changes. Raises ValueError without ZeRO (stage 0),
    FileNotFoundError when a file (a parameter's `fp32.pt`, `latest_universal`) is missing.
    """
    stepper, module = checkpointer.parts.stepper, checkpointer.engine.module
    if checkpointer.parts.zero.stage == 0 or not isinstance(stepper, ZeroStepper):
        raise ValueError(
            "checkpoint.load_universal needs ZeRO stage 1 for a PipelineEngine (a universal checkpoint holds "
            "the optimizer state per parameter, which only the ZeRO optimizers load); set zero_optimization.stage"
        )
    ckpt_dir = _checkpoint.resolve_load_dir(load_dir, tag, universal=True)
    assert ckpt_dir is not None  # universal: a missing latest_universal raises
    path, state = _stage_state(ckpt_dir, stage_id=stage_id, num_stages=num_stages)
    parts, full = _read_weights(stepper, module, ckpt_dir)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name in full:
                param.copy_(full[name].view_as(param).to(param.dtype))
    if load_module_only:
        stepper.refresh_from_module()
    else:
        stepper.load_partitions(parts, load_optimizer_states=load_optimizer_states, load_from_fp32_weights=True)
        checkpointer.restore_progress(state, load_lr_scheduler_states=load_lr_scheduler_states)
    logger.info("loaded universal checkpoint %s into pipeline stage %d", ckpt_dir, stage_id)
    return str(path), state
