"""Loss scalers for fp16 training: static, and dynamic with DeepSpeed's hysteresis semantics."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients still overflow at `min_loss_scale`: the run is diverging, not just unlucky."""


class LossScaler:
    """A fixed loss scale (1.0 for fp32/bf16 training, `fp16.loss_scale` when it is non-zero).

    Args:
        scale: the multiplier applied to the loss before backward.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.cur_scale = float(scale)
        self.cur_iter = 0

    @property
    def loss_scale(self) -> float:
        """The current multiplier (DeepSpeed's name)."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale` (the loss itself when the scale is 1, to keep the graph untouched)."""
        return loss if self.cur_scale == 1.0 else loss * self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """Record one step; a static scale never changes."""
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "dynamic": self.dynamic, "cur_iter": self.cur_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state.get("cur_iter", 0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cur_scale={self.cur_scale})"


class DynamicLossScaler(LossScaler):
    """A loss scale that halves on overflow and doubles after `scale_window` clean steps.

    Semantics (DeepSpeed's): on an overflow, if `delayed_shift == 1` or the hysteresis budget is down
    to 1, the scale is divided by `scale_factor` (never below `min_scale`); otherwise one unit of
    hysteresis is spent and the scale stays. After `scale_window` consecutive clean steps since the
    last overflow the scale is multiplied by `scale_factor` and the hysteresis budget refilled. With
    `consecutive_hysteresis` the budget is refilled on every clean step, so only consecutive
    overflows lower the scale.

    Args:
        init_scale: starting scale (`2 ** fp16.initial_scale_power`, default 2**16).
        scale_factor: multiplier for raising and lowering the scale.
        scale_window: clean steps before the scale is raised (`fp16.loss_scale_window`).
        min_scale: floor of the scale (`fp16.min_loss_scale`).
        delayed_shift: hysteresis, overflows tolerated before lowering (`fp16.hysteresis`).
        consecutive_hysteresis: refill hysteresis on every clean step (`fp16.consecutive_hysteresis`).
        raise_error_at_min_scale: raise `LossScaleAtMinimumError` on an overflow at `min_scale`.

    Raises:
        ValueError: a non-positive scale, factor <= 1, window < 1 or delayed_shift < 1.
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        super().__init__(init_scale)
        if scale_factor <= 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        if scale_window < 1:
            raise ValueError(f"scale_window (fp16.loss_scale_window) must be >= 1, got {scale_window}")
        if min_scale <= 0:
            raise ValueError(f"min_scale (fp16.min_loss_scale) must be > 0, got {min_scale}")
        if delayed_shift < 1:
            raise ValueError(f"delayed_shift (fp16.hysteresis) must be >= 1, got {delayed_shift}")
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = int(delayed_shift)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.last_overflow_iter = -1

    def update_scale(self, overflow: bool) -> None:
        """Advance one step; `overflow` must already agree across ranks (see `has_overflow`)."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale <= self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed with the loss scale already at its minimum ({self.min_scale}); "
                        "the run is diverging. Lower the learning rate, use bf16, or set fp16.min_loss_scale lower."
                    )
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                logger.info("gradient overflow: loss scale %s -> %s", self.cur_scale, new_scale)
                self.cur_scale = new_scale
            else:
                self.cur_hysteresis -= 1
                logger.info(
                    "gradient overflow: hysteresis left %d, loss scale stays %s", self.cur_hysteresis, self.cur_scale
                )
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_steps = self.cur_iter - self.last_overflow_iter - 1
            if stable_steps > 0 and stable_steps % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            cur_hysteresis=self.cur_hysteresis,
            last_overflow_iter=self.last_overflow_iter,
            scale_factor=self.scale_factor,
            scale_window=self.scale_window,
            min_scale=self.min_scale,
            delayed_shift=self.delayed_shift,
            consecutive_hysteresis=self.consecutive_hysteresis,
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.cur_hysteresis = int(state.get("cur_hysteresis", self.delayed_shift))
        self.last_overflow_iter = int(state.get("last_overflow_iter", -1))


def create_loss_scaler(
    dtype: torch.dtype, *, static_loss_scale: float = 0.0, dynamic_scaling: bool = True, **dynamic_args: Any
) -> LossScaler:
    """The scaler a precision mode needs: dynamic for fp16 with `loss_scale == 0`, else static.

    Args:
        dtype: the training dtype; only fp16 ever gets a scale other than 1.
        static_loss_scale: `fp16.loss_scale`; 0 means dynamic.
        dynamic_scaling: allow a dynamic scaler at all.
        dynamic_args: keyword arguments of `DynamicLossScaler`.
    """
    if dtype == torch.float16:
        if dynamic_scaling and static_loss_scale == 0:
            return DynamicLossScaler(**dynamic_args)
        return LossScaler(static_loss_scale or 1.0)
    return LossScaler(1.0)
