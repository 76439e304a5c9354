"""`deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`: the mmap indexed dataset (`.bin`/`.idx`)."""

from __future__ import annotations

from ds_engine._data.indexed_dataset import DTYPE_CODES as dtypes
from ds_engine._data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    code,
    data_file_path,
    dataset_exists,
    get_available_dataset_impl,
    index_file_path,
    infer_dataset_impl,
    make_builder,
    make_dataset,
    valid_dtypes,
)

__all__ = [
    "MMapIndexedDataset",
    "MMapIndexedDatasetBuilder",
    "code",
    "data_file_path",
    "dataset_exists",
    "dtypes",
    "get_available_dataset_impl",
    "index_file_path",
    "infer_dataset_impl",
    "make_builder",
    "make_dataset",
    "valid_dtypes",
]
