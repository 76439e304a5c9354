"""DeepSpeed's ZenFlow attributes on the engine (`engine.zenflow`, `engine.update_interval`, ...).

DeepSpeed's engine sets them from `zero_optimization.zenflow` at construction and clients read them;
here they answer from the schedule the ZenFlow optimizer resolved (`ds_zero.ZenFlowSchedule`), and as
DeepSpeed's do when the section is absent.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["EngineZenFlow"]


class EngineZenFlow:
    """`zenflow`, `select_interval`, `update_interval`, `auto_update`, `overlap_step`, `full_warm_up_rounds`."""

    _zenflow: Any

    @property
    def zenflow(self) -> bool:
        """Whether ZenFlow runs (a `zero_optimization.zenflow` section)."""
        return self._zenflow is not None

    @property
    def select_interval(self) -> int:
        """Micro steps between column reselections (0: select once, after warm-up)."""
        return int(self._zenflow.select_interval) if self._zenflow is not None else 0

    @property
    def update_interval(self) -> int:
        """Micro steps between CPU updates (with `update_interval: "auto"`: the current window's micro steps
        so far, as DeepSpeed's engine counts them)."""
        if self._zenflow is None:
            return 0
        rule = getattr(getattr(self, "optimizer", None), "auto_update", None)
        return int(rule.window) if rule is not None else int(self._zenflow.update_interval)

    @property
    def auto_update(self) -> bool:
        """DeepSpeed's adaptive update interval (`update_interval: "auto"`)."""
        return bool(self._zenflow is not None and self._zenflow.auto_update)

    @property
    def overlap_step(self) -> bool:
        """Whether the CPU update runs overlapped with the next micro steps."""
        return bool(self._zenflow.overlap_step) if self._zenflow is not None else False

    @property
    def full_warm_up_rounds(self) -> int:
        """Leading micro steps with full updates."""
        return int(self._zenflow.full_warm_up_rounds) if self._zenflow is not None else 0

    def _is_zenflow_update_boundary(self) -> bool:
        """DeepSpeed's name: whether the coming `step()` applies the CPU update."""
        return bool(self._zenflow is not None and self.optimizer.is_zenflow_update_boundary(self.micro_steps))  # type: ignore[attr-defined]
