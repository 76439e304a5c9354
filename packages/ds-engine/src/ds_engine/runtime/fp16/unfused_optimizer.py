"""`deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer`: ds's 16-bit wrapper (see `runtime.fp16`)."""

from __future__ import annotations

from ds_engine._step.precision import MixedPrecisionOptimizer as FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]
