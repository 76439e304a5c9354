"""DeepSpeed's `deepspeed.autotuning.tuner.model_based_tuner`."""

from __future__ import annotations

from ds_launcher._autotuning.tuners import INIT_NUM, ModelBasedTuner

__all__ = ["INIT_NUM", "ModelBasedTuner"]
