"""`LossScaleView`: DeepSpeed's `optimizer.loss_scale_config`, read live from a ds loss scaler.

DeepSpeed 0.19.8's fp16/bf16 optimizers keep their scaling settings and counters in a `LossScaleConfig`
record (`dynamic_loss_scale`, `cur_scale`, `cur_iter`, `scale_window`, ...) that clients and tests read
through `optimizer.loss_scale_config`. ds keeps one source of truth, the scaler itself, so this view holds
no copy: every attribute reads the scaler at the moment it is asked.
"""

from __future__ import annotations

from ds_ops.precision._loss_scaler import LossScaler

__all__ = ["LossScaleView"]


class LossScaleView:
    """DeepSpeed's `LossScaleConfig` fields over `scaler` (read-only; the dynamic-only ones are None for a
    static scale, as in DeepSpeed)."""

    __slots__ = ("_scaler",)

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the scale adapts to overflows."""
        return bool(self._scaler.dynamic)

    @property
    def use_grad_scaling(self) -> bool:
        """Whether the loss is multiplied at all (dynamic, or a static scale other than 1)."""
        return self.dynamic_loss_scale or self._scaler.cur_scale != 1.0

    @property
    def cur_scale(self) -> float:
        return float(self._scaler.cur_scale)

    @property
    def cur_iter(self) -> int:
        return int(self._scaler.cur_iter)

    def _dynamic_only(self, name: str) -> float | int | None:
        return getattr(self._scaler, name) if self.dynamic_loss_scale else None

    @property
    def last_overflow_iter(self) -> int | None:
        value = self._dynamic_only("last_overflow_iter")
        return None if value is None else int(value)

    @property
    def scale_factor(self) -> float | None:
        return self._dynamic_only("scale_factor")

    @property
    def scale_window(self) -> int | None:
        value = self._dynamic_only("scale_window")
        return None if value is None else int(value)

    @property
    def min_loss_scale(self) -> float | None:
        return self._dynamic_only("min_scale")

    def __repr__(self) -> str:
        return (
            f"LossScaleView(dynamic_loss_scale={self.dynamic_loss_scale}, cur_scale={self.cur_scale}, "
            f"cur_iter={self.cur_iter}, scale_window={self.scale_window})"
        )
