"""DeepSpeed's `deepspeed.autotuning.tuner.index_based_tuner`."""

from __future__ import annotations

from ds_launcher._autotuning.tuners import GridSearchTuner, RandomTuner

__all__ = ["GridSearchTuner", "RandomTuner"]
