"""`deepspeed.runtime.data_pipeline.data_sampling.data_analyzer`: `DataAnalyzer` and `DistributedDataAnalyzer`."""

from __future__ import annotations

from ds_engine._data.analyzer import DataAnalyzer
from ds_engine._data.distributed_analyzer import DistributedDataAnalyzer

__all__ = ["DataAnalyzer", "DistributedDataAnalyzer"]
