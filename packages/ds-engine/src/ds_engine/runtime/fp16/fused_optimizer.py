"""`deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer`: ds's 16-bit wrapper (see `runtime.fp16`)."""

from __future__ import annotations

from ds_engine._step.precision import MixedPrecisionOptimizer as FP16_Optimizer

__all__ = ["FP16_Optimizer"]
