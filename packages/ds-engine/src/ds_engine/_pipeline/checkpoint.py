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

`PipelineCheckpointer` is the plain engine's `Checkpointer` with the layer files written first
(`weights_writer`), the stage layout in the model-states file (`train_state`) and this loader.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import ds_comm
from ds_engine._checkpoint import checkpoint as _checkpoint
from ds_engine._checkpoint.checkpointer import CheckpointedEngine, Checkpointer, CheckpointParts
from ds_engine._checkpoint.decoupled import QueuedFiles
from ds_engine._checkpoint.train_state import ENGINE_KEYS, TrainState
from ds_engine._pipeline.universal import load_pipeline_universal

logger = logging.getLogger(__name__)

__all__ = ["LAYOUT_KEY", "CheckpointedPipeline", "PipelineCheckpointer"]

LAYOUT_KEY = "pipeline_layout"


class CheckpointedPipeline(CheckpointedEngine, Protocol):
    """What a `PipelineCheckpointer` needs beyond a plain engine's: the stage layout and its grid."""

    num_stages: int
    stage_id: int
    grid: Any
    """ds-pipe's process grid (`get_slice_parallel_world_size`: the tensor-parallel degree)."""

    def layout(self) -> dict[str, Any]:
        """The stage layout a checkpoint's optimizer state depends on (stage count, layer boundaries)."""


class PipelineCheckpointer(Checkpointer):
    """Saves and loads a `PipelineEngine`: weights per layer, engine state per stage (module docstring)."""

    engine: CheckpointedPipeline

    replica_writes_allowed = False
    """Each stage's model states are written by its data-parallel rank 0 alone (REPLICA is the plain engine's)."""

    def __init__(self, engine: CheckpointedPipeline, parts: CheckpointParts) -> None:
        super().__init__(engine, parts)

    def train_state(
        self, rng_states: list[dict[str, Any]], exclude_frozen_parameters: bool, extra: dict[str, Any] | None = None
    ) -> TrainState:
        """The stage's state: no module (its weights are in the layer files), the stage layout besides.

        With ZeRO, `param_shapes` are this stage's parameters (DeepSpeed writes them; a universal conversion
        reads them), and `tp_degree` is the grid's tensor-parallel (`model` axis) degree: the model-states
        files are numbered stage-major, `mp_rank = stage * tp_degree + tp_rank`.
        """
        state = super().train_state(rng_states, exclude_frozen_parameters, extra)
        return dataclasses.replace(
            state,
            module=None,
            pp_degree=self.engine.num_stages,
            tp_degree=self.engine.grid.get_slice_parallel_world_size(),
            extra={**(extra or {}), LAYOUT_KEY: self.engine.layout()},
        )

    def weights_writer(self, exclude_frozen_parameters: bool) -> Callable[[Path], None]:
        """Per-layer weight files by global layer index (data-parallel rank 0 of each stage writes them; queued
        like the rest under a decoupled writer, as DeepSpeed's decoupled engine queues them)."""
        save_state_dict: Callable[..., None] = self.engine.module.save_state_dict  # type: ignore[assignment]
        queued = (
            None
            if self.decoupled is None
            else QueuedFiles(self.decoupled, serialization=self.parts.settings.checkpoint_serialization)
        )
        return functools.partial(
            save_state_dict, checkpoint_engine=queued, exclude_frozen_params=exclude_frozen_parameters
        )

    def load(
        self,
        load_dir: str | Path,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """See `PipelineEngine.load_checkpoint`."""
        if custom_load_fn is not None:
            raise ValueError(
                "load_checkpoint: custom_load_fn is not supported for a PipelineEngine (weights load per "
                "layer through PipelineModule.load_state_dir); pass custom_load_fn=None"
            )
        if self.parts.settings.load_universal:
            universal_path, state = load_pipeline_universal(
                self,
                load_dir,
                tag,
                stage_id=self.engine.stage_id,
                num_stages=self.engine.num_stages,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
            )
            return universal_path, {k: v for k, v in (state or {}).items() if k not in (*ENGINE_KEYS, LAYOUT_KEY)}
        ckpt_dir = _checkpoint.resolve_load_dir(load_dir, tag)
        if ckpt_dir is None:
            return None, None
        path, state = self._read_stage_state(ckpt_dir)
        restore_optimizer = load_optimizer_states and not load_module_only and self.parts.stepper is not None
        if restore_optimizer:
            self._check_layout(state, ckpt_dir)  # before any weight changes
        self.engine.module.load_state_dir(ckpt_dir, strict=load_module_strict)  # type: ignore[operator]
        if restore_optimizer:
            self._load_stage_optimizer(state, ckpt_dir)
        else:
            self._refresh_masters()
        if not load_module_only:
            self.restore_progress(state, load_lr_scheduler_states=load_lr_scheduler_states)
        client_state = {k: v for k, v in state.items() if k not in (*ENGINE_KEYS, LAYOUT_KEY)}
        return str(path), client_state

    def _refresh_masters(self) -> None:
        """Re-derive fp32 masters (fp16/bf16, ZeRO) from the just loaded module weights."""
        stepper = self.parts.stepper
        if stepper is None:
            return
        if self.parts.zero.stage > 0:
            stepper.optimizer.refresh_fp32_params()  # type: ignore[attr-defined]  # ZeRO: a ZeroStepper
        else:
            stepper.refresh_from_module()

    def _read_stage_state(self, ckpt_dir: Path) -> tuple[Path, dict[str, Any]]:
        """This stage's states file when the layout matches, else stage 0's (counters and scheduler are shared)."""
        first = _checkpoint.model_file(ckpt_dir, 0)
        own = _checkpoint.model_file(ckpt_dir, self.parts.dist.mp_rank)
        path = own if own.is_file() else first
        if not path.is_file():
            raise FileNotFoundError(f"load_checkpoint: {path} does not exist; is {ckpt_dir} a pipeline checkpoint?")
        state = ds_comm.load_checkpoint_file(path)
        if not self._layout_matches(state) and path != first:
            path = first
            state = ds_comm.load_checkpoint_file(path)
        return path, state

    def _layout_matches(self, state: dict[str, Any]) -> bool:
        """Whether a stage's states file was saved with this engine's stage layout.

        ds records the layout (`LAYOUT_KEY`). DeepSpeed records only the stage count
        (`checkpoint_parallel_dimensions.pp_degree`): then the stage's parameters must be this stage's, in
        order, by shape (ZeRO's `param_shapes`), or by number (the stage-0 optimizer's param groups).
        """
        saved, layout = state.get(LAYOUT_KEY), self.engine.layout()
        if saved is not None or "ds_version" not in state:
            return bool(saved == layout)
        dims = state.get("checkpoint_parallel_dimensions") or {}
        if dims.get("pp_degree", state.get("mp_world_size")) != layout["num_stages"]:
            return False
        mine = [tuple(p.shape) for p in self.engine.module.parameters() if p.requires_grad]
        if state.get("param_shapes"):
            return [tuple(s) for group in state["param_shapes"] for s in group.values()] == mine
        optimizer = state.get("optimizer") or {}
        groups = (
            optimizer.get("param_groups") or (optimizer.get("optimizer_state_dict") or {}).get("param_groups") or []
        )
        return sum(len(g["params"]) for g in groups) == len(mine)

    def _check_layout(self, state: dict[str, Any], ckpt_dir: Path) -> None:
        if self._layout_matches(state):
            return
        mine, saved = self.engine.layout(), state.get(LAYOUT_KEY)
        raise ValueError(
            f"load_checkpoint: {ckpt_dir} was saved with {saved.get('num_stages') if saved else '?'} pipeline "
            f"stages (layer boundaries {saved.get('partitions') if saved else '?'}); this engine has "
            f"{mine['num_stages']} (boundaries {mine['partitions']}). Optimizer state only loads into the same "
            "stage layout: pass load_optimizer_states=False (or load_module_only=True) to load the weights, lr "
            "scheduler and counters and start the optimizer afresh"
        )

    def _load_stage_optimizer(self, state: dict[str, Any], ckpt_dir: Path) -> None:
        stepper = self.parts.stepper
        if stepper is None:
            return
        fp32 = self.parts.zero.load_from_fp32_weights
        if self.parts.zero.stage > 0:
            partitions = _checkpoint.zero_partitions(ckpt_dir, self.parts.dist.mp_rank)
            stepper.load_partitions(  # type: ignore[attr-defined]  # ZeRO: a ZeroStepper
                partitions, load_optimizer_states=True, load_from_fp32_weights=fp32
            )
        elif state.get("optimizer") is not None:
            stepper.load_state_dict(state["optimizer"], load_from_fp32_weights=fp32)
        else:
            logger.warning(
                "checkpoint %s has no stage-0 optimizer state (saved with ZeRO?); optimizer not restored", ckpt_dir
            )
            self._refresh_masters()
