"""`deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr`: dynamic batching (variable batch
size and lr scaling)."""

from __future__ import annotations

from ds_engine._data.dynamic_batching import get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed
from ds_engine._data.variable_batch import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)

__all__ = [
    "VariableBatchSizeLR",
    "batch_by_seqlens",
    "dataloader_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
    "lr_scheduler_for_variable_batch_size",
    "scale_lr",
]
