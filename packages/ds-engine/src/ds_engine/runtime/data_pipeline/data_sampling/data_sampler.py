"""`deepspeed.runtime.data_pipeline.data_sampling.data_sampler`: `DeepSpeedDataSampler` (curriculum learning)."""

from __future__ import annotations

from ds_engine._data.sampler import DeepSpeedDataSampler

__all__ = ["DeepSpeedDataSampler"]
