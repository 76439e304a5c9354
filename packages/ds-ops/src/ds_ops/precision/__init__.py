"""Precision helpers shared by ds-zero and ds-engine: loss scalers, overflow checks, gradient norms, and
`finish_step`, the one unscale -> check -> scale update -> norm -> clip sequence every stepper runs, and
`WrappedOptimizer`, the torch-optimizer face every wrapping optimizer shows."""

from __future__ import annotations

from ds_ops.precision._grad_norm import clip_grads_by_norm_, global_grad_norm, local_norm_term
from ds_ops.precision._loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    LossScaler,
    create_loss_scaler,
)
from ds_ops.precision._overflow import has_overflow, local_overflow, unscale_and_check_
from ds_ops.precision._step import GradStats, StepOutcome, finish_step, grad_norm_groups
from ds_ops.precision._wrapped_optimizer import WrappedOptimizer

__all__ = [
    "DynamicLossScaler",
    "GradStats",
    "LossScaleAtMinimumError",
    "LossScaler",
    "StepOutcome",
    "WrappedOptimizer",
    "clip_grads_by_norm_",
    "create_loss_scaler",
    "finish_step",
    "global_grad_norm",
    "grad_norm_groups",
    "has_overflow",
    "local_norm_term",
    "local_overflow",
    "unscale_and_check_",
]
