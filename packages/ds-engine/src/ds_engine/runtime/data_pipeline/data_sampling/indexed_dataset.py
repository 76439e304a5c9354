"""`deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`: the mmap indexed dataset (`.bin`/`.idx`)."""

from __future__ import annotations

from ds_engine._data.indexed_dataset import DTYPE_CODES as dtypes
from ds_engine._data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    code,
    data_file_path,
    index_file_path,
    valid_dtypes,
)

__all__ = [
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "code",
    "data_file_path",
    "dtypes",
    "index_file_path",
    "valid_dtypes",
]
