"""Helpers the analyzer and the sampler share: the smallest integer dtype for a range, work splits, builders."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ds_engine._data.indexed_dataset import MMapIndexedDatasetBuilder

logger = logging.getLogger(__name__)

__all__ = [
    "close_mmap_dataset_builder",
    "create_mmap_dataset_builder",
    "find_fit_int_dtype",
    "split_dataset",
    "split_index",
]

_UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)
_SIGNED = (np.int8, np.int16, np.int32, np.int64)


def find_fit_int_dtype(min_value: int, max_value: int) -> type[np.integer]:
    """The narrowest numpy integer dtype holding `[min_value, max_value]`: unsigned when `min_value >= 0`."""
    if min_value >= 0:
        for dt in _UNSIGNED:
            if max_value <= np.iinfo(dt).max:
                return dt
        return np.uint64
    for sdt in _SIGNED:
        info = np.iinfo(sdt)
        if info.min <= min_value and max_value <= info.max:
            return sdt
    return np.int64


def split_index(start_idx: int, end_idx: int, num_partitions: int) -> list[tuple[int, int]]:
    """`num_partitions` contiguous `(start, end)` ranges covering `[start_idx, end_idx)`, as even as integer
    rounding of equally spaced boundaries makes them."""
    bounds = np.linspace(start_idx, end_idx, num=num_partitions + 1, dtype=int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(num_partitions)]


def split_dataset(
    dataset: Any, num_workers: int, worker_id: int, num_threads: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every worker's range of `dataset`, and `worker_id`'s range split among its `num_threads` threads."""
    worker_splits = split_index(0, len(dataset), num_workers)
    thread_splits = split_index(worker_splits[worker_id][0], worker_splits[worker_id][1], num_threads)
    return worker_splits, thread_splits


def create_mmap_dataset_builder(fname: str, dtype: Any) -> MMapIndexedDatasetBuilder:
    """A builder writing `fname.bin` (finish it with `close_mmap_dataset_builder`)."""
    logger.info("creating mmap dataset builder at %s", fname)
    return MMapIndexedDatasetBuilder(f"{fname}.bin", dtype=dtype)


def close_mmap_dataset_builder(builder: MMapIndexedDatasetBuilder, fname: str) -> None:
    """End the builder's document and write `fname.idx`."""
    builder.end_document()
    builder.finalize(f"{fname}.idx")
    logger.info("finalized mmap dataset at %s", fname)
