"""`deepspeed.runtime.bf16_optimizer.BF16_Optimizer`: ds's 16-bit wrapper, which bf16 at stage 0 uses.

DeepSpeed has a separate bf16 wrapper; ds's `MixedPrecisionOptimizer` serves fp16 and bf16 alike (fp32
masters, a static scale of 1 and an optional overflow check for bf16), so `BF16_Optimizer` names it.
"""

from __future__ import annotations

from ds_engine._step.precision import MixedPrecisionOptimizer as BF16_Optimizer

__all__ = ["BF16_Optimizer"]
