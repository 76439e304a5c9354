"""Config-time checks of `zero_optimization.zenflow`, before anything is built (DeepSpeed 0.19.8's rules).

ds runs ZenFlow at ZeRO stages 1 and 2 with CPU optimizer offload (ds-zero's `ZenFlowZeroOptimizer`). The
section's own combinations (`select_strategy` against `select_interval`, the intervals' order, the
adaptive `update_interval`) are ds-zero's `ZenFlowSchedule` rules, checked here as well so a bad
config fails in `initialize()` before the model is touched, naming the key.
"""

from __future__ import annotations

import logging
from typing import Any

from ds_engine._optional import require
from ds_engine.config._errors import DeepSpeedConfigError

logger = logging.getLogger(__name__)

__all__ = ["ZENFLOW_STAGE3", "check_zenflow"]

ZENFLOW_STAGE3 = (
    "zero_optimization.zenflow at zero_optimization.stage 3 is not supported in ds yet; use stage 1 or 2 with "
    'offload_optimizer.device "cpu", or remove the zenflow section'
)


def check_zenflow(cfg: Any) -> None:
    """Refuse what ZenFlow cannot run with, naming the key (`cfg`: ds-zero's validated `ZeroConfig`).

    Raises:
        DeepSpeedConfigError: stage 3, no CPU optimizer offload, `zenflow.offload` without `overlap_comm`,
            or an interval combination `ZenFlowSchedule` refuses.
    """
    zenflow = getattr(cfg, "zenflow", None)
    if zenflow is None:
        return
    if cfg.stage == 3:
        raise DeepSpeedConfigError(ZENFLOW_STAGE3)
    if cfg.stage not in (1, 2):
        raise DeepSpeedConfigError(
            "zero_optimization.zenflow needs zero_optimization.stage 1 or 2 with CPU optimizer offload, got "
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
    schedule = require("ds_zero", extra="zero", feature="zero_optimization.zenflow").ZenFlowSchedule
    try:
        schedule.from_config(zenflow)
    except ValueError as err:
        raise DeepSpeedConfigError(str(err)) from None
