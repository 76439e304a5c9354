"""DeepSpeed's `deepspeed.autotuning.tuner.cost_model`: ds's cost model is a ridge regression (no XGBoost)."""

from __future__ import annotations

from ds_launcher._autotuning.tuners import RidgeCostModel

__all__ = ["RidgeCostModel"]
