"""DeepSpeed's `deepspeed.autotuning.tuner`: the grid, random and model-based tuners."""

from __future__ import annotations

from ds_launcher._autotuning.tuners import GridSearchTuner, ModelBasedTuner, RandomTuner

__all__ = ["GridSearchTuner", "ModelBasedTuner", "RandomTuner"]
