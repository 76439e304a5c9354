"""`deepspeed.runtime.data_pipeline.data_sampling.utils`: integer dtypes for ranges, work splits, builders."""

from __future__ import annotations

from ds_engine._data.index_utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
    split_dataset,
    split_index,
)

__all__ = [
    "close_mmap_dataset_builder",
    "create_mmap_dataset_builder",
    "find_fit_int_dtype",
    "split_dataset",
    "split_index",
]
