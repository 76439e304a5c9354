"""Loading PipelineEngine checkpoints: weights per layer (any stage count reloads them), engine state per stage.

Layout of `save_dir/<tag>` (DeepSpeed's names):
    layer_XX-model_states.pt                      one per layer by global index (PipelineModule.save_state_dict)
    mp_rank_{stage:02d}_model_states.pt           per stage: module None, stage-0 optimizer, lr scheduler,
                                                  counters, every rank's RNG, the stage layout
    zero_pp_rank_{dp}_mp_rank_{stage:02d}_optim_states.pt   ZeRO-1: each rank's partition of its stage

[Note: changing the stage count] Layer files are keyed by global layer index, so the weights load
into any number of stages. Optimizer state is per stage (which parameters a stage's optimizer
holds depends on the partition), so it loads only into the layout it was saved with; a different
layout needs `load_optimizer_states=False`, which still restores the lr scheduler and counters
(from `mp_rank_00`) and rebuilds any fp32 masters from the loaded weights.

With `checkpoint.load_universal` the checkpoint is a universal one instead (`_pipeline.universal`):
it loads at any stage count and data-parallel degree, optimizer state included.

Saving is the plain engine's `_checkpoint.write_checkpoint`, with the layer files written first
(`PipelineEngine._weights_writer`) and the stage layout in the model-states file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ds_comm
from ds_engine._checkpoint import checkpoint as _checkpoint
from ds_engine._checkpoint.train_state import ENGINE_KEYS
from ds_engine._pipeline.universal import load_pipeline_universal

if TYPE_CHECKING:
    from ds_engine._pipeline.engine import PipelineEngine

logger = logging.getLogger(__name__)

__all__ = ["LAYOUT_KEY", "load_pipeline_checkpoint"]

LAYOUT_KEY = "pipeline_layout"


def _refresh_masters(engine: PipelineEngine) -> None:
    """Re-derive fp32 masters (fp16/bf16, ZeRO) from the just loaded module weights."""
    if engine._stepper is None:
        return
    if engine._zero.stage > 0:
        engine._stepper.optimizer.refresh_fp32_params()
    else:
        engine._stepper.refresh_from_module()


def _read_stage_state(engine: PipelineEngine, ckpt_dir: Path) -> tuple[Path, dict[str, Any]]:
    """This stage's states file when the layout matches, else stage 0's (counters and scheduler are shared)."""
    own = _checkpoint.model_file(ckpt_dir, engine._mp_rank)
    path = own if own.is_file() else _checkpoint.model_file(ckpt_dir, 0)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: {path} does not exist; is {ckpt_dir} a pipeline checkpoint?")
    state = ds_comm.load_checkpoint_file(path)
    if not _layout_matches(engine, state) and path != _checkpoint.model_file(ckpt_dir, 0):
        path = _checkpoint.model_file(ckpt_dir, 0)
        state = ds_comm.load_checkpoint_file(path)
    return path, state


def _layout_matches(engine: PipelineEngine, state: dict[str, Any]) -> bool:
    """Whether a stage's states file was saved with this engine's stage layout.

    ds records the layout (`LAYOUT_KEY`). DeepSpeed records only the stage count
    (`checkpoint_parallel_dimensions.pp_degree`): then the stage's parameters must be this stage's, in
    order, by shape (ZeRO's `param_shapes`), or by number (the stage-0 optimizer's param groups).
    """
    saved = state.get(LAYOUT_KEY)
    if saved is not None or "ds_version" not in state:
        return bool(saved == engine.layout())
    dims = state.get("checkpoint_parallel_dimensions") or {}
    if dims.get("pp_degree", state.get("mp_world_size")) != engine.layout()["num_stages"]:
        return False
    mine = [tuple(p.shape) for p in engine.module.parameters() if p.requires_grad]
    if state.get("param_shapes"):
        return [tuple(s) for group in state["param_shapes"] for s in group.values()] == mine
    optimizer = state.get("optimizer") or {}
    groups = optimizer.get("param_groups") or (optimizer.get("optimizer_state_dict") or {}).get("param_groups") or []
    return sum(len(g["params"]) for g in groups) == len(mine)


def _check_layout(engine: PipelineEngine, state: dict[str, Any], ckpt_dir: Path) -> None:
    mine = engine.layout()
    if _layout_matches(engine, state):
        return
    saved = state.get(LAYOUT_KEY)
    raise ValueError(
        f"load_checkpoint: {ckpt_dir} was saved with {saved.get('num_stages') if saved else '?'} pipeline stages "
        f"(layer boundaries {saved.get('partitions') if saved else '?'}); this engine has {mine['num_stages']} "
        f"(boundaries {mine['partitions']}). Optimizer state only loads into the same stage layout: pass "
        "load_optimizer_states=False (or load_module_only=True) to load the weights, lr scheduler and counters "
        "and start the optimizer afresh"
    )


def _load_optimizer(engine: PipelineEngine, state: dict[str, Any], ckpt_dir: Path) -> None:
    stepper = engine._stepper
    if stepper is None:
        return
    fp32 = engine._zero.load_from_fp32_weights
    if engine._zero.stage > 0:
        parts = _checkpoint.zero_partitions(ckpt_dir, engine._mp_rank)
        stepper.load_partitions(parts, load_optimizer_states=True, load_from_fp32_weights=fp32)
    elif state.get("optimizer") is not None:
        stepper.load_state_dict(state["optimizer"], load_from_fp32_weights=fp32)
    else:
        logger.warning(
            "checkpoint %s has no stage-0 optimizer state (saved with ZeRO?); optimizer not restored", ckpt_dir
        )
        _refresh_masters(engine)


def load_pipeline_checkpoint(
    engine: PipelineEngine,
    load_dir: str | Path,
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    custom_load_fn: Any = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """See `PipelineEngine.load_checkpoint`."""
    if custom_load_fn is not None:
        raise ValueError(
            "load_checkpoint: custom_load_fn is not supported for a PipelineEngine (weights load per "
            "layer through PipelineModule.load_state_dir); pass custom_load_fn=None"
        )
    if engine._ckpt_config.load_universal:
        path, state = load_pipeline_universal(
            engine,
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        return path, {k: v for k, v in (state or {}).items() if k not in (*ENGINE_KEYS, LAYOUT_KEY)}
    ckpt_dir = _checkpoint.resolve_load_dir(load_dir, tag)
    if ckpt_dir is None:
        return None, None
    path, state = _read_stage_state(engine, ckpt_dir)
    restore_optimizer = load_optimizer_states and not load_module_only and engine._stepper is not None
    if restore_optimizer:
        _check_layout(engine, state, ckpt_dir)  # before any weight changes
    engine.module.load_state_dir(ckpt_dir, strict=load_module_strict)
    if restore_optimizer:
        _load_optimizer(engine, state, ckpt_dir)
    else:
        _refresh_masters(engine)
    if not load_module_only:
        _checkpoint.restore_progress(engine, state, load_lr_scheduler_states=load_lr_scheduler_states)
    client_state = {k: v for k, v in state.items() if k not in (*ENGINE_KEYS, LAYOUT_KEY)}
    return str(path), client_state
