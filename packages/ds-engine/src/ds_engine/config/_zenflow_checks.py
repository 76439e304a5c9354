"""Config-time checks of `zero_optimization.zenflow`, before anything is built (DeepSpeed 0.19.8's rules).

ds runs ZenFlow at ZeRO stages 1 and 2 (ds-zero's `ZenFlowZeroOptimizer`) and 3 (`ZenFlowZeroOptimizer_Stage3`,
on any accelerator, where DeepSpeed's needs CUDA), with CPU optimizer offload. The
section's own combinations (`select_strategy` against `select_interval`, the intervals' order)
are ds-zero's `ZenFlowSchedule` rules, checked here as well so a bad
config fails in `initialize()` before the model is touched, naming the key.
"""

from __future__ import annotations

import logging
from typing import Any

from ds_engine._optional import require
from ds_engine.config._errors import DeepSpeedConfigError

logger = logging.getLogger(__name__)

__all__ = ["check_zenflow"]


def check_zenflow(cfg: Any) -> None:
    """Refuse what ZenFlow cannot run with, naming the key (`cfg`: ds-zero's validated `ZeroConfig`).

    Raises:
        DeepSpeedConfigError: stage 0, no CPU optimizer offload, `zenflow.offload` without `overlap_comm`,
            an interval combination `ZenFlowSchedule` refuses, or (stage 3) SuperOffload or partial offload.
    """
    zenflow = getattr(cfg, "zenflow", None)
    if zenflow is None:
        return
    if cfg.stage not in (1, 2, 3):
        raise DeepSpeedConfigError(
            "zero_optimization.zenflow needs zero_optimization.stage 1, 2 or 3 with CPU optimizer offload, got "
            f"stage {cfg.stage}"
        )
    if cfg.offload_optimizer_device != "cpu":
        raise DeepSpeedConfigError(
            'zero_optimization.zenflow needs zero_optimization.offload_optimizer.device "cpu" (the unimportant '
            f"gradients are applied by the CPU optimizer), got {cfg.offload_optimizer_device!r}"
        )
    if zenflow.offload and not cfg.overlap_comm:
        raise DeepSpeedConfigError(
            "zero_optimization.zenflow.offload=true needs zero_optimization.overlap_comm=true, as in DeepSpeed"
        )
    if cfg.stage == 3:
        off = cfg.offload_optimizer_or_default
        if off.super_offload:
            raise DeepSpeedConfigError(
                "zero_optimization.zenflow with zero_optimization.offload_optimizer.super_offload=true: both "
                "change when the CPU optimizer steps; use one of them"
            )
        if off.ratio < 1.0:
            raise DeepSpeedConfigError(
                f"zero_optimization.zenflow with zero_optimization.offload_optimizer.ratio={off.ratio}: ZenFlow "
                "applies the CPU update to every partition; set ratio 1 or remove the zenflow section"
            )
    schedule = require("ds_zero", extra="zero", feature="zero_optimization.zenflow").ZenFlowSchedule
    try:
        schedule.from_config(zenflow)
    except ValueError as err:
        raise DeepSpeedConfigError(str(err)) from None
