"""What ZenFlow's stage-1/2 and stage-3 optimizers share: the engine-facing schedule queries, the selective
optimizer's lr, and restoring an `overlap_step` checkpoint's worker state.

Each optimizer keeps its own data layout (flat partitions at stage 1/2, shards at stage 3); the one place a
shared method touches it, putting back the model's delayed values, is the `_restore_overlapped_model` hook.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ds_zero._zenflow.overlap import OverlappedCpuUpdate

__all__ = ["ZenFlowOptimizerCommon"]

logger = logging.getLogger(__name__)


class ZenFlowOptimizerCommon:
    """Mixed into `ZenFlowZeroOptimizer` and `ZenFlowZeroOptimizer_Stage3` (before their ZeRO base)."""

    selective_optimizer: torch.optim.Optimizer
    optimizer: torch.optim.Optimizer
    auto_update: Any
    zenflow_schedule: Any
    micro_step: int
    _cpu: Any

    def _sync_selective_optimizer_lr(self) -> None:
        """Copy each base group's lr into the selective optimizer (the engine calls it at each `step()`)."""
        for selective, group in zip(self.selective_optimizer.param_groups, self.optimizer.param_groups, strict=True):
            selective["lr"] = group["lr"]

    def is_zenflow_update_boundary(self, micro_step: int) -> bool:
        """Whether the `step()` after micro step `micro_step` applies the CPU update (DeepSpeed's engine rule;
        with `update_interval: "auto"` also where the adaptive rule ended the window)."""
        auto = self.auto_update is not None and self.auto_update.ends(micro_step)
        return auto or self.zenflow_schedule.is_update_boundary(micro_step)

    def zenflow_resume_at(self, micro_steps: int) -> None:
        """Continue ZenFlow's schedule after `micro_steps` micro steps (the engine's restored counter): a
        checkpoint loaded without the optimizer state (or without ZenFlow's) restarts the selection and the
        window, at the schedule's position the engine resumes at."""
        self.micro_step = int(micro_steps) - 1

    def _load_overlap(self, saved: Mapping[str, Any] | None) -> None:
        """`overlap_step`: the worker's state and pending result, and the model's own (delayed) values."""
        if not isinstance(self._cpu, OverlappedCpuUpdate):
            return
        if saved is None:
            logger.warning("ZenFlow: the checkpoint has no overlap_step state; the CPU moments start afresh")
            return
        self._cpu.load_state_dict(dict(saved))
        with torch.no_grad():
            self._restore_overlapped_model(saved["model"])

    def _restore_overlapped_model(self, values: list[torch.Tensor | None]) -> None:
        """Put back the model's own values an `overlap_step` checkpoint saved (they lag the masters)."""
        raise NotImplementedError(f"{type(self).__name__} must restore its overlapped model values")
