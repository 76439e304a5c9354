"""Precision helpers shared by ds-zero and ds-engine: loss scalers, overflow checks, gradient norms."""

from __future__ import annotations

from ds_ops.precision._grad_norm import clip_grads_by_norm_, global_grad_norm
from ds_ops.precision._loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    create_loss_scaler,
)
from ds_ops.precision._overflow import has_overflow, local_overflow, unscale_and_check_

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimumError",
    "LossScaler",
    "clip_grads_by_norm_",
    "create_loss_scaler",
    "global_grad_norm",
    "has_overflow",
    "local_overflow",
    "unscale_and_check_",
]
