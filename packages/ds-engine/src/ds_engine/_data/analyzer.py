"""`DataAnalyzer`: compute per-sample metrics over a dataset (map) and index the data by them (reduce).

Map: worker `worker_id` of `num_workers` takes its contiguous share of the dataset and splits it among
`num_threads` processes; each walks its share in batches (`batch_size`, `collate_fn`) and applies every
metric function to a batch. Under `save_path/<metric>/worker<w>_thread<t>/` it writes:

- `single_value_per_sample` (one integer per sample): `<metric>_sample_to_metric` (an mmap indexed
  dataset, one row per sample) and `<metric>_metric_to_sample_<value>.csv` (the samples with that value,
  comma-separated rows, appended in sample order);
- `accumulate_value_over_samples` (a tensor summed over batches): `<metric>_metric_value`.

Reduce (worker 0, after every worker's map; `num_threads_reduce` processes): under `save_path/<metric>/`,
`<metric>_sample_to_metric` (all samples, in the narrowest integer dtype of the value range),
`<metric>_index_to_metric` (row r: the r-th smallest value) and `<metric>_index_to_sample` (row r: its
samples, ascending), `<metric>_index_to_sample_percentile_merged` (rows of about 1% of the values
merged), each also as per-reduce-process `_thread<r>` pieces; and `<metric>_metric_value` for
accumulated metrics. The names, layout and bytes are DeepSpeed 0.19.8's, so its curriculum sampler reads
them and ds's reads DeepSpeed's.
"""

from __future__ import annotations

import csv
import glob
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from ds_engine._data.analyzer_reduce import MetricReducer, run_processes, write_index_to_sample_percentile
from ds_engine._data.index_utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    split_dataset,
)
from ds_engine._data.indexed_dataset import valid_dtypes

logger = logging.getLogger(__name__)

__all__ = ["METRIC_TYPES", "DataAnalyzer", "write_index_to_sample_percentile"]

METRIC_TYPES = ("single_value_per_sample", "accumulate_value_over_samples")
#: a value's pending sample list is appended to its csv file once it holds more than this many samples
_CSV_FLUSH = 100


def _same_dtype(a: Any, b: Any) -> bool:
    """True when two numpy/torch dtypes are the same element type."""
    if isinstance(a, torch.dtype) or isinstance(b, torch.dtype):
        if isinstance(a, torch.dtype) and isinstance(b, torch.dtype):
            return a == b
        t, other = (a, b) if isinstance(a, torch.dtype) else (b, a)
        return torch.empty(0, dtype=t).numpy().dtype == np.dtype(other)
    return np.dtype(a) == np.dtype(b)


def _append_csv(path: str, samples: list[int]) -> None:
    with open(path, "a", newline="") as f:
        csv.writer(f, lineterminator="\r\n").writerow(samples)


class DataAnalyzer(MetricReducer):
    """Map/reduce of metric functions over `dataset` (see the module docstring for the files).

    `metric_functions[i](batch)` returns a tensor or array of dtype `metric_dtypes[i]`: one value per sample
    of the batch for `single_value_per_sample`, any shape for `accumulate_value_over_samples`. A batch that
    is a dict with an `index` entry names its samples' dataset indices (`batch["index"][row][0]`);
    otherwise `sample_indices[i]`, when given, is the index of the i-th sample in iteration order.
    `custom_map_init/update/finalize` and `custom_reduce` replace the built-in steps with the same arguments.
    """

    def __init__(
        self,
        dataset: Any,
        num_workers: int = 1,
        worker_id: int = 0,
        num_threads: int = 1,
        num_threads_reduce: int = 1,
        specific_threads: Sequence[int] = (),
        batch_size: int = 1,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[Callable[[Any], Any]] = (),
        metric_types: Sequence[str] = (),
        metric_dtypes: Sequence[Any] = (),
        save_path: str = "./",
        collate_fn: Callable[..., Any] | None = None,
        custom_map_init: Callable[..., Any] | None = None,
        custom_map_update: Callable[..., Any] | None = None,
        custom_map_finalize: Callable[..., Any] | None = None,
        custom_reduce: Callable[..., Any] | None = None,
        sample_indices: Sequence[int] | None = None,
    ) -> None:
        n = len(metric_names)
        if not (len(metric_functions) == len(metric_types) == n) or (metric_dtypes and len(metric_dtypes) != n):
            raise ValueError(
                "DataAnalyzer: metric_names, metric_functions, metric_types and metric_dtypes need one entry "
                f"per metric; got {n}, {len(metric_functions)}, {len(metric_types)} and {len(metric_dtypes)}"
            )
        for name, mtype in zip(metric_names, metric_types, strict=False):
            if mtype not in METRIC_TYPES:
                raise ValueError(f"DataAnalyzer: metric_types for {name!r} is {mtype!r}; use one of {METRIC_TYPES}")
        for name, mdtype in zip(metric_names, metric_dtypes, strict=False):
            if mdtype not in valid_dtypes:
                raise ValueError(
                    f"DataAnalyzer: metric_dtypes for {name!r} is {mdtype}, not an integer dtype of the index format"
                )
        if not 0 <= worker_id < num_workers or num_threads < 1 or num_threads_reduce < 1:
            raise ValueError(
                f"DataAnalyzer: need 0 <= worker_id < num_workers and at least one thread; got worker_id "
                f"{worker_id}, num_workers {num_workers}, num_threads {num_threads}, "
                f"num_threads_reduce {num_threads_reduce}"
            )
        self.dataset = dataset
        self.num_workers = num_workers
        self.worker_id = worker_id
        self.num_threads = num_threads
        self.num_threads_reduce = num_threads_reduce
        self.specific_threads = list(specific_threads)
        self.batch_size = batch_size
        self.metric_names = list(metric_names)
        self.metric_functions = list(metric_functions)
        self.metric_types = list(metric_types)
        self.metric_dtypes = list(metric_dtypes)
        self.save_path = str(save_path)
        self.collate_fn = collate_fn
        self.custom_map_init = custom_map_init
        self.custom_map_update = custom_map_update
        self.custom_map_finalize = custom_map_finalize
        self.custom_reduce = custom_reduce
        self.sample_indices = sample_indices

    # -- map ----------------------------------------------------------------------------------------------
    def init_metric_results(
        self,
        thread_id: int,
        metric_names: Sequence[str],
        metric_types: Sequence[str],
        metric_dtypes: Sequence[Any],
        save_path: str,
        worker_id: int,
    ) -> list[dict[str, Any]]:
        """Open this thread's output files (removing stale csv files of an earlier run)."""
        results: list[dict[str, Any]] = []
        for name, mtype, mdtype in zip(metric_names, metric_types, metric_dtypes, strict=False):
            out = f"{save_path}/{name}/worker{worker_id}_thread{thread_id}/"
            os.makedirs(out, exist_ok=True)
            if mtype == "single_value_per_sample":
                s2m = f"{out}/{name}_sample_to_metric"
                m2s = f"{out}/{name}_metric_to_sample"
                for stale in glob.glob(f"{glob.escape(m2s)}*"):
                    os.remove(stale)
                results.append(
                    {
                        "sample_to_metric_fname": s2m,
                        "sample_to_metric_builder": create_mmap_dataset_builder(s2m, mdtype),
                        "metric_to_sample_fname": m2s,
                        "metric_to_sample_dict": defaultdict(list),
                    }
                )
            else:
                results.append({"metric_value": None, "metric_value_fname": f"{out}/{name}_metric_value"})
        return results

    def _sample_index(self, data: Any, row: int, position: int) -> int:
        if isinstance(data, dict) and "index" in data:
            return int(data["index"][row][0].item())
        if self.sample_indices is not None:
            return int(self.sample_indices[position])
        return position

    def update_metric_results(
        self,
        data: Any,
        metric_types: Sequence[str],
        metric_dtypes: Sequence[Any],
        metric_functions: Sequence[Callable[[Any], Any]],
        metric_results: list[dict[str, Any]],
        batch_start_idx: int = 0,
    ) -> None:
        """Apply every metric to one batch whose first sample is `batch_start_idx` in iteration order."""
        for mtype, mdtype, fn, result in zip(
            metric_types, metric_dtypes, metric_functions, metric_results, strict=False
        ):
            values = fn(data)
            if not (torch.is_tensor(values) or isinstance(values, np.ndarray)):
                raise TypeError(f"a metric function returned {type(values).__name__}; it must return a tensor or array")
            if not _same_dtype(values.dtype, mdtype):
                raise TypeError(
                    f"a metric function returned dtype {values.dtype}, but its metric_dtypes entry is {mdtype}"
                )
            values = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
            if mtype == "single_value_per_sample":
                pending = result["metric_to_sample_dict"]
                for row in range(values.size(0)):
                    result["sample_to_metric_builder"].add_item(values[row].reshape(-1))
                    pending[values[row].item()].append(self._sample_index(data, row, batch_start_idx + row))
                for value, samples in pending.items():
                    if len(samples) > _CSV_FLUSH:
                        _append_csv(f"{result['metric_to_sample_fname']}_{value}.csv", samples)
                        pending[value] = []
            elif result["metric_value"] is None:
                result["metric_value"] = values
            else:
                result["metric_value"].add_(values)

    def finalize_metric_results(
        self, metric_types: Sequence[str], metric_dtypes: Sequence[Any], metric_results: list[dict[str, Any]]
    ) -> None:
        """Close this thread's files: the sample_to_metric index, the remaining csv rows, the accumulated value."""
        for mtype, mdtype, result in zip(metric_types, metric_dtypes, metric_results, strict=False):
            if mtype == "single_value_per_sample":
                close_mmap_dataset_builder(result["sample_to_metric_builder"], result["sample_to_metric_fname"])
                for value, samples in result["metric_to_sample_dict"].items():
                    if samples:
                        _append_csv(f"{result['metric_to_sample_fname']}_{value}.csv", samples)
                        result["metric_to_sample_dict"][value] = []
            elif result["metric_value"] is not None:
                builder = create_mmap_dataset_builder(result["metric_value_fname"], mdtype)
                builder.add_item(result["metric_value"].reshape(-1))
                close_mmap_dataset_builder(builder, result["metric_value_fname"])

    def run_map_helper(self, thread_id: int) -> None:
        """Map one thread's share of this worker's samples."""
        start, end = self.thread_splits[thread_id]
        logger.info("worker %d thread %d: samples %d to %d", self.worker_id, thread_id, start, end)
        subset = Subset(self.dataset, list(range(start, end)))
        sampler = BatchSampler(SequentialSampler(subset), batch_size=self.batch_size, drop_last=False)
        loader = DataLoader(subset, batch_sampler=sampler, num_workers=0, collate_fn=self.collate_fn)
        init = self.custom_map_init or self.init_metric_results
        update = self.custom_map_update or self.update_metric_results
        finalize = self.custom_map_finalize or self.finalize_metric_results
        results = init(
            thread_id, self.metric_names, self.metric_types, self.metric_dtypes, self.save_path, self.worker_id
        )
        done = 0
        for data in loader:
            update(data, self.metric_types, self.metric_dtypes, self.metric_functions, results, start + done)
            done += len(data)
        finalize(self.metric_types, self.metric_dtypes, results)
        logger.info("worker %d thread %d: finished %d samples", self.worker_id, thread_id, done)

    def run_map(self) -> None:
        """Map this worker's share, one process per thread when `num_threads > 1`."""
        self.worker_splits, self.thread_splits = split_dataset(
            self.dataset, self.num_workers, self.worker_id, self.num_threads
        )
        threads = self.specific_threads or list(range(self.num_threads))
        if self.num_threads == 1:
            self.run_map_helper(0)
            return
        run_processes([(self.run_map_helper, (t,)) for t in threads])

    # -- reduce (MetricReducer) ----------------------------------------------------------------------------
    def run_reduce(self) -> None:
        reduce = self.custom_reduce or self.merge_map_results
        reduce(
            self.dataset,
            self.metric_names,
            self.metric_types,
            self.save_path,
            self.num_workers,
            self.num_threads,
            self.num_threads_reduce,
        )

    def run_map_reduce(self, comm_group: Any = None) -> None:
        """Map this worker's share, wait for every worker, reduce on worker 0, wait again (collective
        over `comm_group` when torch.distributed is initialized)."""
        self.run_map()
        _barrier(comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        _barrier(comm_group)


def _barrier(group: Any) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)
