"""`ZenFlowConfig`: the `zero_optimization.zenflow` section, with DeepSpeed 0.19.8's keys and defaults.

ZenFlow is DeepSpeed's importance-aware ZeRO-Offload: each step the top `topk_ratio` gradient columns
are updated at once on the accelerator (ds-ops' `ZenFlowSelectiveAdamW`), the rest are accumulated and
applied by the CPU optimizer every `update_interval` steps, possibly overlapped with the next forward
and backward. ds runs it with `ZenFlowZeroOptimizer` (ZeRO 1/2) and `ZenFlowZeroOptimizer_Stage3`; the
plain ZeRO optimizers given an enabled section refuse it (`ds_zero._zenflow_refusal`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ds_comm import ConfigModel

__all__ = ["ZenFlowConfig"]


class ZenFlowConfig(ConfigModel):
    """`zero_optimization.zenflow`: which gradient columns are important, and how often the rest are applied.

    A present section (even `{}`) means ZenFlow is on, as in DeepSpeed; `null` or absent means off.
    """

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    """Share of gradient columns selected as important each step (0 < ratio < 1)."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """When the important columns are reselected: every `select_interval` steps or epochs ("auto": epochs)."""
    select_interval: Literal["auto"] | int = "auto"
    """Steps or epochs between reselections ("auto": every epoch)."""
    update_interval: Literal["auto"] | int = "auto"
    """Steps between applications of the accumulated unimportant gradients ("auto": adaptive, see `auto_ratio`)."""
    overlap_step: bool = False
    """Overlap the CPU optimizer's update with the next forward and backward."""
    offload: bool = False
    """Keep the selective optimizer's moments on the host."""
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    """With update_interval "auto": the threshold that decides when to apply the accumulated gradients."""
    full_warm_up_rounds: int = Field(0, ge=0)
    """Initial steps that update every column (no selection)."""
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    """Share of this rank's cores kept for the training process; the rest run the CPU optimizer."""
    steps_per_epoch: int | None = Field(None, exclude=True)
    """Filled in by the training loop at run time; not meant to be set in a config."""

    @model_validator(mode="after")
    def _intervals(self) -> ZenFlowConfig:
        for name in ("select_interval", "update_interval"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 1:
                raise ValueError(f'{name} must be "auto" or a whole number >= 1, got {value!r}')
        return self
