"""`DistributedDataAnalyzer`: the data analyzer's map/reduce over torch.distributed ranks, in memory.

Each rank (worker) maps its contiguous share of the dataset (split among `num_threads` processes when
asked), keeping `(value, sample)` pairs and accumulated tensors in memory instead of per-thread files.
The reduce is collective: the pairs travel to rank 0 (two int64 per sample), which writes the same final
files as `DataAnalyzer.run_reduce` under `save_path/<metric>/` (`_sample_to_metric`, `_index_to_metric`,
`_index_to_sample`, `_index_to_sample_percentile_merged`, `_metric_value`), their `.bin` files byte for
byte; accumulated metrics are summed with a reduce. Every rank must call `run_map_reduce()`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from multiprocessing import get_context
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, Subset

from ds_comm import get_accelerator
from ds_engine._data.analyzer import METRIC_TYPES, write_index_to_sample_percentile
from ds_engine._data.index_utils import (
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
    split_dataset,
)
from ds_engine._data.indexed_dataset import valid_dtypes

logger = logging.getLogger(__name__)

__all__ = ["DistributedDataAnalyzer"]


class DistributedDataAnalyzer:
    """Collective metric analysis (see the module docstring). With `comm_group`, the workers are its ranks;
    otherwise `num_workers`/`worker_id` (normally the world size and this rank). `device`: where collective
    buffers live (default: CPU under gloo, the accelerator's device otherwise)."""

    def __init__(
        self,
        dataset: Any,
        num_workers: int = 1,
        num_threads: int = 1,
        worker_id: int = 0,
        batch_size: int = 1,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[Callable[[Any], Any]] = (),
        metric_types: Sequence[str] = (),
        save_path: str = "./",
        collate_fn: Callable[..., Any] | None = None,
        device: str | torch.device | None = None,
        comm_group: Any = None,
        sample_indices: Sequence[int] | None = None,
    ) -> None:
        if not (len(metric_names) == len(metric_functions) == len(metric_types)):
            raise ValueError(
                "DistributedDataAnalyzer: metric_names, metric_functions and metric_types need one entry per metric"
            )
        for name, mtype in zip(metric_names, metric_types, strict=False):
            if mtype not in METRIC_TYPES:
                raise ValueError(
                    f"DistributedDataAnalyzer: metric_types for {name!r} is {mtype!r}; use one of {METRIC_TYPES}"
                )
        self.dataset = dataset
        self.batch_size = batch_size
        self.metric_names = list(metric_names)
        self.metric_functions = list(metric_functions)
        self.metric_types = list(metric_types)
        self.save_path = str(save_path)
        self.collate_fn = collate_fn
        self.sample_indices = sample_indices
        self.num_threads = max(1, num_threads or 1)
        self.comm_group = comm_group
        if comm_group is None:
            self.num_workers, self.worker_id = num_workers, worker_id
        else:
            self.num_workers, self.worker_id = tdist.get_world_size(comm_group), tdist.get_rank(comm_group)
        self.device = torch.device(device) if device is not None else None
        self._local = False

    # -- map ----------------------------------------------------------------------------------------------
    def run_map_helper(self, thread_id: int = 0) -> list[Any]:
        """One thread's results: per metric, `[(value, sample), ...]` or the accumulated tensor."""
        start, end = self.thread_splits[thread_id]
        subset = Subset(self.dataset, list(range(start, end)))
        loader = DataLoader(
            subset,
            batch_sampler=BatchSampler(SequentialSampler(subset), batch_size=self.batch_size, drop_last=False),
            num_workers=0,
            collate_fn=self.collate_fn,
        )
        results: list[Any] = [[] if t == "single_value_per_sample" else None for t in self.metric_types]
        position = start
        for data in loader:
            for m, (mtype, fn) in enumerate(zip(self.metric_types, self.metric_functions, strict=False)):
                values = fn(data)
                if not (torch.is_tensor(values) or isinstance(values, np.ndarray)):
                    raise TypeError(
                        f"metric {self.metric_names[m]!r} returned {type(values).__name__}, not a tensor or array"
                    )
                values = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
                if values.dtype not in valid_dtypes:
                    raise TypeError(
                        f"metric {self.metric_names[m]!r} returned dtype {values.dtype}, not an integer dtype"
                    )
                if mtype == "single_value_per_sample":
                    for row in range(values.size(0)):
                        if isinstance(data, dict) and "index" in data:
                            sample = int(data["index"][row][0].item())
                        elif self.sample_indices is not None:
                            sample = int(self.sample_indices[position + row])
                        else:
                            sample = position + row
                        results[m].append((int(values[row].item()), sample))
                elif results[m] is None:
                    results[m] = values.clone()
                else:
                    results[m].add_(values)
            position += len(data)
        return results

    def _thread_worker(self, thread_id: int, queue: Any) -> None:
        results = self.run_map_helper(thread_id)
        queue.put((thread_id, [r.tolist() if torch.is_tensor(r) else r for r in results]))

    def _map(self) -> list[Any]:
        """This worker's results (as `run_map_helper`'s), its threads' merged in sample order."""
        self.worker_splits, self.thread_splits = split_dataset(
            self.dataset, self.num_workers, self.worker_id, self.num_threads
        )
        if self.num_threads == 1:
            return self.run_map_helper(0)
        ctx = get_context("fork")  # the metric functions need not pickle (lambdas are common)
        queue = ctx.Queue()
        procs = [ctx.Process(target=self._thread_worker, args=(t, queue)) for t in range(self.num_threads)]
        for p in procs:
            p.start()
        per_thread = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
        merged: list[Any] = []
        for m, mtype in enumerate(self.metric_types):
            if mtype == "single_value_per_sample":
                merged.append([tuple(pair) for t in range(self.num_threads) for pair in per_thread[t][m]])
            else:
                parts = [
                    torch.tensor(per_thread[t][m]) for t in range(self.num_threads) if per_thread[t][m] is not None
                ]
                merged.append(sum(parts[1:], parts[0]) if parts else None)
        return merged

    # -- reduce -------------------------------------------------------------------------------------------
    def _gather_pairs(self, pairs: list[tuple[int, int]]) -> np.ndarray | None:
        """Every rank's `(value, sample)` rows, in rank order, on rank 0 (None elsewhere)."""
        local = torch.tensor(pairs, dtype=torch.int64, device=self.device).reshape(-1, 2)
        if self._local:
            return local.numpy()
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.num_workers)]
        tdist.all_gather(
            counts, torch.tensor([len(local)], dtype=torch.int64, device=self.device), group=self.comm_group
        )
        longest = int(max(c.item() for c in counts))
        padded = torch.zeros(longest, 2, dtype=torch.int64, device=self.device)
        padded[: len(local)] = local
        root = tdist.get_global_rank(self.comm_group, 0) if self.comm_group is not None else 0
        bufs = [torch.empty_like(padded) for _ in range(self.num_workers)] if self.worker_id == 0 else None
        tdist.gather(padded, bufs, dst=root, group=self.comm_group)
        if self.worker_id != 0:
            return None
        assert bufs is not None
        return torch.cat([b[: int(c.item())] for b, c in zip(bufs, counts, strict=False)]).cpu().numpy()

    def _write_single(self, name: str, pairs: np.ndarray, total: int, sample_dtype: Any) -> None:
        out = f"{self.save_path}/{name}/"
        values, samples = pairs[:, 0], pairs[:, 1]
        value_dtype = find_fit_int_dtype(int(values.min()), int(values.max()))
        s2m = f"{out}/{name}_sample_to_metric"
        builder = create_mmap_dataset_builder(s2m, value_dtype)
        for v in values:
            builder.add_item_numpy(np.asarray([v]))
        close_mmap_dataset_builder(builder, s2m)
        order = np.lexsort((samples, values))
        values, samples = values[order], samples[order]
        unique, starts = np.unique(values, return_index=True)
        im = f"{out}/{name}_index_to_metric"
        isx = f"{out}/{name}_index_to_sample"
        im_builder = create_mmap_dataset_builder(im, value_dtype)
        is_builder = create_mmap_dataset_builder(isx, find_fit_int_dtype(int(samples.min()), int(samples.max())))
        for k, value in enumerate(unique):
            im_builder.add_item_numpy(np.asarray([value]))
            stop = starts[k + 1] if k + 1 < len(starts) else len(samples)
            is_builder.add_item_numpy(samples[starts[k] : stop])
        close_mmap_dataset_builder(im_builder, im)
        close_mmap_dataset_builder(is_builder, isx)
        write_index_to_sample_percentile(isx, im, name, out, total, sample_dtype)

    def run_map_reduce(self) -> None:
        """Map this rank's share, then write the final files on rank 0 (collective; all ranks return after).

        Raises:
            RuntimeError: torch.distributed is not initialized and there is more than one worker (a single
                worker runs without it).
        """
        self._local = not tdist.is_initialized()
        if self._local and self.num_workers != 1:
            raise RuntimeError(
                f"DistributedDataAnalyzer with {self.num_workers} workers needs torch.distributed initialized "
                "(deepspeed.init_distributed())"
            )
        if self._local:
            self.device = torch.device("cpu")
        elif self.device is None:
            gloo = tdist.get_backend(self.comm_group) == "gloo"
            self.device = torch.device("cpu" if gloo else get_accelerator().current_device_name())
        results = self._map()
        total = len(self.dataset)
        sample_dtype = find_fit_int_dtype(0, total - 1)
        for name, mtype, result in zip(self.metric_names, self.metric_types, results, strict=False):
            if self.worker_id == 0:
                os.makedirs(f"{self.save_path}/{name}/", exist_ok=True)
            if mtype == "single_value_per_sample":
                pairs = self._gather_pairs(result)
                if pairs is not None:
                    self._write_single(name, pairs, total, sample_dtype)
            else:
                if result is None:
                    raise RuntimeError(
                        f"worker {self.worker_id} has no samples for accumulated metric {name!r}; use fewer workers"
                    )
                summed = result.to(self.device, torch.int64)
                if not self._local:
                    root = tdist.get_global_rank(self.comm_group, 0) if self.comm_group is not None else 0
                    tdist.reduce(summed, dst=root, op=tdist.ReduceOp.SUM, group=self.comm_group)
                if self.worker_id == 0:
                    summed = summed.cpu().numpy().reshape(-1)
                    fname = f"{self.save_path}/{name}/{name}_metric_value"
                    builder = create_mmap_dataset_builder(
                        fname, find_fit_int_dtype(int(summed.min()), int(summed.max()))
                    )
                    builder.add_item_numpy(summed)
                    close_mmap_dataset_builder(builder, fname)
            if not self._local:
                tdist.barrier(group=self.comm_group)
