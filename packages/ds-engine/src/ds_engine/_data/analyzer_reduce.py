"""The data analyzer's reduce: merge every map worker's and thread's files into the final metric indexes.

`MetricReducer` is `DataAnalyzer`'s reduce half (DeepSpeed's method names: `merge_gather_map_stats`,
`merge_sample_to_metric`, `merge_metric_to_sample`, `merge_map_results`, `output_index_to_sample_percentile`);
it runs on worker 0 after every worker's map, in `num_threads_reduce` processes. The files it writes are
described in `analyzer`'s docstring.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Callable, Sequence
from multiprocessing import get_context
from typing import Any

import numpy as np

from ds_engine._data.index_utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
    split_index,
)
from ds_engine._data.indexed_dataset import MMapIndexedDataset

logger = logging.getLogger(__name__)

__all__ = ["MetricReducer", "run_processes", "write_index_to_sample_percentile"]

#: map and reduce processes fork: metric functions and datasets need not pickle (lambdas are common)
FORK = get_context("fork")


def write_index_to_sample_percentile(
    index_to_sample_fname: str,
    index_to_metric_fname: str,
    metric_name: str,
    metric_save_path: str,
    total_num_samples: int,
    sample_idx_dtype: Any,
) -> dict[Any, int]:
    """Write `<metric>_index_to_sample_percentile_merged` (index_to_sample rows merged in groups of
    `max(1, rows // 100)`) and return value -> sample count."""
    index_to_sample = MMapIndexedDataset(index_to_sample_fname, skip_warmup=True)
    index_to_metric = MMapIndexedDataset(index_to_metric_fname, skip_warmup=True)
    counts: dict[Any, int] = {}
    for v in range(len(index_to_sample)):
        if v > 0 and not index_to_metric[v][0] > index_to_metric[v - 1][0]:
            raise ValueError(f"{index_to_metric_fname}: metric values are not strictly increasing at row {v}")
        counts[index_to_metric[v][0]] = len(index_to_sample[v])
    if sum(counts.values()) != total_num_samples:
        raise ValueError(f"{index_to_sample_fname} holds {sum(counts.values())} samples, not {total_num_samples}")
    merged_fname = f"{metric_save_path}/{metric_name}_index_to_sample_percentile_merged"
    builder = create_mmap_dataset_builder(merged_fname, sample_idx_dtype)
    step = max(1, len(index_to_sample) // 100)
    for v in range(0, len(index_to_sample), step):
        rows = index_to_sample[v : min(len(index_to_sample), v + step)]
        builder.add_item_numpy(np.concatenate(rows, axis=None).astype(np.int64))
    close_mmap_dataset_builder(builder, merged_fname)
    return counts


class MetricReducer:
    """The reduce steps; the analyzer supplies `num_workers`, `num_threads` and `num_threads_reduce`."""

    num_workers: int
    num_threads: int
    num_threads_reduce: int

    output_index_to_sample_percentile = staticmethod(write_index_to_sample_percentile)

    def _map_dirs(self, metric_save_path: str) -> list[tuple[int, int, str]]:
        return [
            (w, t, f"{metric_save_path}/worker{w}_thread{t}/")
            for w in range(self.num_workers)
            for t in range(self.num_threads)
        ]

    def merge_gather_map_stats(
        self,
        num_workers: int,
        num_threads: int,
        num_threads_reduce: int,
        t_idx_reduce: int,
        metric_save_path: str,
        metric_name: str,
        return_dict: Any,
    ) -> None:
        """Unique values and sample counts of the map outputs reduce process `t_idx_reduce` reads."""
        results = []
        for w, t, out in self._map_dirs(metric_save_path):
            if (w * num_threads + t) % num_threads_reduce == t_idx_reduce:
                data = MMapIndexedDataset(f"{out}/{metric_name}_sample_to_metric", skip_warmup=True)
                rows = [int(x) for row in data for x in row]
                results.append([sorted(set(rows)), len(data)])
        return_dict[t_idx_reduce] = results

    def merge_sample_to_metric(
        self,
        t_idx_reduce: int,
        metric_save_path: str,
        metric_name: str,
        metric_value_dtype: Any,
        map_worker_thread: Sequence[Sequence[int]],
    ) -> None:
        """Concatenate the sample_to_metric files of `map_worker_thread`, in the final dtype."""
        fname = f"{metric_save_path}/{metric_name}_sample_to_metric_thread{t_idx_reduce}"
        builder = create_mmap_dataset_builder(fname, metric_value_dtype)
        for w, t in map_worker_thread:
            data = MMapIndexedDataset(f"{metric_save_path}/worker{w}_thread{t}//{metric_name}_sample_to_metric", True)
            for row in range(len(data)):
                builder.add_item_numpy(data[row].astype(np.int64))
        close_mmap_dataset_builder(builder, fname)

    def merge_metric_to_sample(
        self,
        t_idx_reduce: int,
        metric_save_path: str,
        metric_name: str,
        sample_idx_dtype: Any,
        metric_value_dtype: Any,
        unique_metric_values: Sequence[int],
        num_workers: int,
        num_threads: int,
    ) -> None:
        """index_to_sample / index_to_metric rows for `unique_metric_values`, from every map csv file."""
        is_fname = f"{metric_save_path}/{metric_name}_index_to_sample_thread{t_idx_reduce}"
        im_fname = f"{metric_save_path}/{metric_name}_index_to_metric_thread{t_idx_reduce}"
        is_builder = create_mmap_dataset_builder(is_fname, sample_idx_dtype)
        im_builder = create_mmap_dataset_builder(im_fname, metric_value_dtype)
        for value in unique_metric_values:
            samples: list[int] = []
            for _, _, out in self._map_dirs(metric_save_path):
                path = f"{out}/{metric_name}_metric_to_sample_{value}.csv"
                if os.path.isfile(path):
                    with open(path, newline="") as f:
                        for row in csv.reader(f):
                            samples += [int(x) for x in row]
            is_builder.add_item_numpy(np.asarray(samples, dtype=np.int64))
            im_builder.add_item_numpy(np.asarray([value], dtype=np.int64))
        close_mmap_dataset_builder(is_builder, is_fname)
        close_mmap_dataset_builder(im_builder, im_fname)

    def _reduce_single_value(self, metric_name: str, metric_save_path: str, total: int, sample_idx_dtype: Any) -> None:
        manager = FORK.Manager()
        stats = manager.dict()
        R = self.num_threads_reduce
        run_processes(
            [
                (
                    self.merge_gather_map_stats,
                    (self.num_workers, self.num_threads, R, r, metric_save_path, metric_name, stats),
                )
                for r in range(R)
            ],
            force=True,
        )
        unique: set[int] = set()
        count = 0
        for r in range(R):
            for values, n in stats[r]:
                unique.update(values)
                count += n
        manager.shutdown()
        if count != total:
            raise RuntimeError(
                f"the map outputs of metric {metric_name!r} hold {count} samples, the dataset {total}: a map "
                "worker did not finish"
            )
        value_dtype = find_fit_int_dtype(min(unique), max(unique))
        map_threads = [[w, t] for w, t, _ in self._map_dirs(metric_save_path)]
        splits = split_index(0, len(map_threads), R)
        run_processes(
            [
                (self.merge_sample_to_metric, (r, metric_save_path, metric_name, value_dtype, map_threads[a:b]))
                for r, (a, b) in enumerate(splits)
            ]
        )
        s2m = f"{metric_save_path}/{metric_name}_sample_to_metric"
        builder = create_mmap_dataset_builder(s2m, value_dtype)
        for r in range(R):
            builder.merge_file_(f"{metric_save_path}/{metric_name}_sample_to_metric_thread{r}")
        close_mmap_dataset_builder(builder, s2m)

        values = sorted(unique)
        splits = split_index(0, len(values), R)
        run_processes(
            [
                (
                    self.merge_metric_to_sample,
                    (
                        r,
                        metric_save_path,
                        metric_name,
                        sample_idx_dtype,
                        value_dtype,
                        values[a:b],
                        self.num_workers,
                        self.num_threads,
                    ),
                )
                for r, (a, b) in enumerate(splits)
            ]
        )
        is_fname = f"{metric_save_path}/{metric_name}_index_to_sample"
        im_fname = f"{metric_save_path}/{metric_name}_index_to_metric"
        is_builder = create_mmap_dataset_builder(is_fname, sample_idx_dtype)
        im_builder = create_mmap_dataset_builder(im_fname, value_dtype)
        for r in range(R):
            is_builder.merge_file_(f"{metric_save_path}/{metric_name}_index_to_sample_thread{r}")
            im_builder.merge_file_(f"{metric_save_path}/{metric_name}_index_to_metric_thread{r}")
        close_mmap_dataset_builder(is_builder, is_fname)
        close_mmap_dataset_builder(im_builder, im_fname)
        counts = write_index_to_sample_percentile(
            is_fname, im_fname, metric_name, metric_save_path, total, sample_idx_dtype
        )
        self.get_metric_value_percentiles(metric_name, counts, total)

    def get_metric_value_percentiles(
        self, metric_name: str, num_sample_per_value: dict[Any, int], total_num_samples: int
    ) -> None:
        """Log the metric value at every 5th percentile of the samples."""
        seen, pct = 0, 5
        for value in sorted(num_sample_per_value):
            seen += num_sample_per_value[value]
            while pct <= 100 and seen >= total_num_samples * pct / 100.0:
                logger.info("metric %s: %dth percentile %s", metric_name, pct, value)
                pct += 5

    def _reduce_accumulated(self, metric_name: str, metric_save_path: str) -> None:
        total = None
        for _, _, out in self._map_dirs(metric_save_path):
            part = np.copy(MMapIndexedDataset(f"{out}/{metric_name}_metric_value", skip_warmup=True)[0])
            total = part if total is None else total + part
        assert total is not None
        fname = f"{metric_save_path}/{metric_name}_metric_value"
        builder = create_mmap_dataset_builder(fname, find_fit_int_dtype(int(total.min()), int(total.max())))
        builder.add_item_numpy(total.astype(np.int64))
        close_mmap_dataset_builder(builder, fname)

    def merge_map_results(
        self,
        dataset: Any,
        metric_names: Sequence[str],
        metric_types: Sequence[str],
        save_path: str,
        num_workers: int,
        num_threads: int,
        num_threads_reduce: int,
    ) -> None:
        """The reduce: every metric's final files under `save_path/<metric>/`."""
        total = len(dataset)
        sample_idx_dtype = find_fit_int_dtype(0, total - 1)
        for name, mtype in zip(metric_names, metric_types, strict=False):
            metric_save_path = f"{save_path}/{name}/"
            if mtype == "single_value_per_sample":
                self._reduce_single_value(name, metric_save_path, total, sample_idx_dtype)
            else:
                self._reduce_accumulated(name, metric_save_path)


def run_processes(jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]], force: bool = False) -> None:
    """Run each `(fn, args)` in its own process and wait; inline when there is a single job (unless
    `force`, for jobs that write through a Manager proxy anyway). A failed process is an error."""
    if len(jobs) == 1 and not force:
        fn, args = jobs[0]
        fn(*args)
        return
    procs = [FORK.Process(target=fn, args=args) for fn, args in jobs]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"DataAnalyzer: {len(failed)} of {len(procs)} processes failed (exit codes {failed})")
