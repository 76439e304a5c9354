"""`DeepSpeedDataSampler`: curriculum learning by data sampling, batch by batch from clusters of easier data.

Each metric in `data_sampling.curriculum_learning.curriculum_metrics` has a difficulty schedule and (unless
its `clustering_type` is `single_cluster`) the data analyzer's index files: `index_to_sample_path` (row r:
the samples with the r-th smallest metric value) and, for `difficulty_type: value`, `index_to_metric_path`
(row r: that value). Whenever a schedule's difficulty changes, the samples newly admitted (value in
`(previous, current]`, or percentile range `[previous, current)` of the data) form a new cluster, shuffled
and written under `data_cluster_path` as `cluster_<metric><difficulty>...` (an mmap indexed dataset with one
row). Each global batch draws, per sample, a cluster with probability proportional to its size, takes the
next samples of each drawn cluster (reshuffling and restarting one that runs out), and shuffles the batch.

The random stream is DeepSpeed 0.19.8's: one `numpy.random.default_rng(data_efficiency.seed)` consumed in
the same order, so the same config, seed and dataset give the same batches as DeepSpeed's sampler. The
data-parallel leader (dp rank 0 of each group) draws each batch and broadcasts it; every rank yields its
contiguous slice of each micro batch. Clusters are held in memory by the leaders; global rank 0 writes
their files (read back when a checkpoint is loaded, so with several nodes `data_cluster_path` must be a
shared directory, as in DeepSpeed). Whether a cluster was formed is broadcast, not read from the file
system, so every rank of a group agrees on the cluster list even where an older run left files behind.

State (`state_dict`) has DeepSpeed's keys plus `sampler_rng_state`, the generator's own state: DeepSpeed
saves only numpy's global RNG state, so its resumed sampler restarts its stream from the seed; ds
continues the stream where the checkpoint left it when the key is there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from ds_engine._data.curriculum import CurriculumScheduler
from ds_engine._data.index_utils import close_mmap_dataset_builder, create_mmap_dataset_builder, find_fit_int_dtype
from ds_engine._data.indexed_dataset import MMapIndexedDataset

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedDataSampler"]

_CL = "data_efficiency.data_sampling.curriculum_learning"


class DeepSpeedDataSampler:
    """A batch sampler yielding, per micro batch, this rank's sample indices under curriculum learning.

    Args:
        data_efficiency_config: the `data_efficiency` section as a dict (DeepSpeed's keys, defaults filled).
        one_epoch_total_samples: `len(dataset)`.
        micro_batch_size: samples per rank per micro batch.
        data_parallel_rank / data_parallel_size / data_parallel_group: this rank's place among the
            data-parallel replicas (the group may be None when the size is 1 or for the default group).
        gradient_accumulation_steps: micro batches per global batch.
        global_rank: this process's global rank.
        drop_last: drop a trailing micro batch smaller than `micro_batch_size * data_parallel_size`.
    """

    def __init__(
        self,
        data_efficiency_config: Mapping[str, Any],
        one_epoch_total_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_parallel_group: Any,
        gradient_accumulation_steps: int,
        global_rank: int,
        drop_last: bool = True,
    ) -> None:
        sampling = data_efficiency_config["data_sampling"]
        self.data_efficiency_config = data_efficiency_config
        self.one_epoch_total_samples = one_epoch_total_samples
        self.index_dtype = find_fit_int_dtype(0, one_epoch_total_samples)
        self.total_samples = one_epoch_total_samples * sampling["num_epochs"]
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_parallel_group = data_parallel_group
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self.np_rng = np.random.default_rng(data_efficiency_config["seed"])
        self.batch: list[int] = []
        self.consumed_samples = 0
        if self.total_samples <= 0:
            raise ValueError(
                f"no sample to consume: {one_epoch_total_samples} samples x data_efficiency.data_sampling."
                f"num_epochs {sampling['num_epochs']}"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size must be > 0")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not in [0, {data_parallel_size})")

        cl = sampling["curriculum_learning"]
        self.curriculum_enabled = bool(cl["enabled"])
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.curriculum_schedulers: dict[str, CurriculumScheduler] = {}
        self.curriculum_index_to_sample: dict[str, MMapIndexedDataset] = {}
        self.curriculum_index_to_metric: dict[str, MMapIndexedDataset] = {}
        self.difficulty_type: dict[str, str] = {}
        self.clustering_type: dict[str, str] = {}
        self.data_1epoch_size: int | None = None
        self.data_clusters: list[Sequence[np.ndarray]] = []  # each a dataset of one row: the shuffled cluster
        self.data_cluster_sizes: list[int] = []
        if not self.curriculum_enabled:
            return
        self.cluster_root = cl["data_cluster_path"]
        if self.is_leader:
            os.makedirs(self.cluster_root, exist_ok=True)
        for metric, mconf in cl["curriculum_metrics"].items():
            where = f"{_CL}.curriculum_metrics.{metric}"
            self.curriculum_schedulers[metric] = CurriculumScheduler(mconf, path=where)
            self.difficulty_type[metric] = mconf["difficulty_type"]
            self.clustering_type[metric] = mconf["clustering_type"]
            if self.is_leader and mconf["clustering_type"] != "single_cluster":
                self.curriculum_index_to_sample[metric] = MMapIndexedDataset(
                    mconf["index_to_sample_path"], skip_warmup=True
                )
                if mconf["difficulty_type"] == "value":
                    self.curriculum_index_to_metric[metric] = MMapIndexedDataset(
                        mconf["index_to_metric_path"], skip_warmup=True
                    )

    @property
    def is_leader(self) -> bool:
        """The rank that draws batches and writes cluster files (data-parallel rank 0)."""
        return self.data_parallel_rank == 0

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], Any]]) -> None:
        """Give metrics with `schedule_type: custom` their `fn(global_step) -> difficulty`."""
        for metric, schedule in self.curriculum_schedulers.items():
            if metric in schedule_func_dict:
                schedule.set_custom_get_difficulty(schedule_func_dict[metric])

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's `[start, end)` slice of a micro batch of `batch_len` samples across all DP ranks."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size

        def start(r: int) -> int:
            return round(r * batch_len / self.data_parallel_size)

        return start(self.data_parallel_rank), start(self.data_parallel_rank + 1)

    # -- clusters -----------------------------------------------------------------------------------------
    def get_sample_based_on_metric_value(self, metric: str, value_start: float, value_end: float) -> np.ndarray | None:
        """Samples whose `metric` value lies in `(value_start, value_end]`, in index-file order."""
        rows = [
            np.copy(self.curriculum_index_to_sample[metric][row])
            for row in range(len(self.curriculum_index_to_sample[metric]))
            if value_start < self.curriculum_index_to_metric[metric][row][0] <= value_end
        ]
        return np.concatenate(rows, axis=None) if rows else None

    def get_sample_based_on_metric_percentile(
        self, metric: str, percentile_start: int, percentile_end: int
    ) -> np.ndarray | None:
        """Samples ranked `[start, end)` by `metric`, in percentile units of `max_difficulty` (the last one
        takes the remainder of the division)."""
        index = self.curriculum_index_to_sample[metric]
        if self.data_1epoch_size is None:
            self.data_1epoch_size = int(sum(len(x) for x in index))
        max_percentile = self.data_efficiency_config["data_sampling"]["curriculum_learning"]["curriculum_metrics"][
            metric
        ]["max_difficulty"]
        per_percentile = self.data_1epoch_size // max_percentile
        start_count = per_percentile * percentile_start
        end_count = self.data_1epoch_size if percentile_end == max_percentile else per_percentile * percentile_end
        rows = []
        seen = 0
        for row in range(len(index)):
            row_size = int(index.size(row))
            if seen + row_size > start_count:
                row_start = max(0, start_count - seen)
                row_end = row_size if seen + row_size <= end_count else end_count - seen
                rows.append(np.copy(index[row][row_start:row_end]))
            seen += row_size
            if seen >= end_count:
                break
        return np.concatenate(rows, axis=None) if rows else None

    def _metric_cluster(self, metric: str, low: Any, high: Any) -> np.ndarray | None:
        if self.difficulty_type[metric] == "value":
            return self.get_sample_based_on_metric_value(metric, low, high)
        return self.get_sample_based_on_metric_percentile(metric, low, high)

    def _new_cluster_samples(self, previous_difficulties: Mapping[str, Any]) -> np.ndarray | None:
        """The samples newly admitted at the current difficulties (leader only)."""
        clustered = [m for m in self.curriculum_schedulers if self.clustering_type[m] != "single_cluster"]
        if len(clustered) > 1:
            # several metrics: everything within all current difficulties, minus what earlier clusters hold
            cluster: np.ndarray | None = None
            for metric in self.curriculum_schedulers:
                if self.clustering_type[metric] == "single_cluster":
                    part: np.ndarray | None = np.arange(0, self.one_epoch_total_samples, 1, dtype=self.index_dtype)
                else:
                    low = float("-inf") if self.difficulty_type[metric] == "value" else 0
                    part = self._metric_cluster(metric, low, self.current_difficulties[metric])
                if cluster is None:
                    cluster = part
                elif part is None:  # numpy cannot intersect with None
                    raise ValueError(
                        f"curriculum metric {metric!r} has no sample up to difficulty "
                        f"{self.current_difficulties[metric]!r}; check its index files and difficulty schedule"
                    )
                else:
                    cluster = np.intersect1d(cluster, part, assume_unique=True)
            if cluster is None:  # no metric's index held a sample in range: nothing is admitted
                return None
            for existing in self.data_clusters:
                cluster = np.setdiff1d(cluster, existing[0], assume_unique=True)
            return cluster
        cluster = None
        if not self.data_clusters:
            cluster = np.arange(0, self.one_epoch_total_samples, 1, dtype=self.index_dtype)
        for metric in clustered:
            cluster = self._metric_cluster(metric, previous_difficulties[metric], self.current_difficulties[metric])
        return cluster

    def _cluster_path(self, fname: str) -> str:
        return f"{self.cluster_root}/{fname}"

    def get_new_cluster(self, previous_difficulties: Mapping[str, Any]) -> None:
        """Form and shuffle the cluster of newly admitted samples (the leader) and write its file (global rank
        0); every rank of the data-parallel group records its name when it is not empty."""
        fname = "cluster" + "".join(f"_{m}{self.current_difficulties[m]}" for m in self.curriculum_schedulers)
        formed = False
        if self.is_leader:
            cluster = self._new_cluster_samples(previous_difficulties)
            formed = cluster is not None and len(cluster) > 0
            if formed and cluster is not None:
                logger.info(
                    "new data cluster (difficulties %s -> %s) of %d samples",
                    dict(previous_difficulties),
                    self.current_difficulties,
                    len(cluster),
                )
                cluster = np.asarray(cluster).astype(self.index_dtype)
                self.np_rng.shuffle(cluster)
                self._keep_cluster(fname, cluster)
            else:
                logger.info("no sample is newly admitted at difficulties %s; no cluster", self.current_difficulties)
        if self._broadcast_flag(formed):
            self.data_cluster_paths.append(fname)
            self.data_cluster_current_position.append(0)

    def _keep_cluster(self, fname: str, cluster: np.ndarray, cidx: int | None = None) -> None:
        """Hold a cluster in memory (as a one-row dataset) and write its file from global rank 0 (read back
        when a checkpoint is loaded). Other data-parallel groups' leaders hold the same cluster without
        writing the same file at the same time."""
        if self.global_rank == 0:
            path = self._cluster_path(fname)
            builder = create_mmap_dataset_builder(path, self.index_dtype)
            builder.add_item_numpy(cluster)
            close_mmap_dataset_builder(builder, path)
        if cidx is None:
            self.data_clusters.append([cluster])
            self.data_cluster_sizes.append(len(cluster))
        else:
            self.data_clusters[cidx] = [cluster]

    def sample_from_clusters(self) -> np.ndarray:
        """How many samples of the next global batch come from each cluster (drawn by cluster size)."""
        total = sum(self.data_cluster_sizes)
        weights = [size / total for size in self.data_cluster_sizes]
        picks = self.np_rng.choice(len(self.data_clusters), self.global_batch_size, replace=True, p=weights)
        return np.bincount(picks, minlength=len(self.data_clusters))

    def reshuffle_clusters(self, cidx: int) -> None:
        """Shuffle cluster `cidx` again (it ran out) and rewrite its file."""
        cluster = np.copy(self.data_clusters[cidx][0])
        self.np_rng.shuffle(cluster)
        self._keep_cluster(self.data_cluster_paths[cidx], cluster, cidx)

    def get_sample_from_cluster(self, cidx: int, num_samples: int) -> list[Any]:
        """The next `num_samples` of cluster `cidx`, wrapping around (with a reshuffle) at its end."""
        start = self.data_cluster_current_position[cidx]
        samples = list(np.copy(self.data_clusters[cidx][0][start : start + num_samples]))
        self.data_cluster_current_position[cidx] += num_samples
        if len(samples) < num_samples:
            remaining = num_samples - len(samples)
            logger.info("reshuffling data cluster %d", cidx)
            self.reshuffle_clusters(cidx)
            samples += list(np.copy(self.data_clusters[cidx][0][:remaining]))
            self.data_cluster_current_position[cidx] = remaining
        return samples

    # -- batches ------------------------------------------------------------------------------------------
    def get_next_global_batch(self) -> None:
        """Advance the curriculum one step and draw the next global batch into `self.batch`."""
        if not self.curriculum_enabled:
            return
        self.curriculum_step += 1
        new_cluster = False
        previous: dict[str, Any] = {}
        for metric, schedule in self.curriculum_schedulers.items():
            difficulty = schedule.update_difficulty(self.curriculum_step)
            if metric not in self.current_difficulties or difficulty != self.current_difficulties[metric]:
                new_cluster = True
            if metric in self.current_difficulties:
                previous[metric] = self.current_difficulties[metric]
            else:
                previous[metric] = float("-inf") if self.difficulty_type[metric] == "value" else 0
            self.current_difficulties[metric] = difficulty
        if new_cluster:
            self.get_new_cluster(previous)
        if self.is_leader:
            per_cluster = self.sample_from_clusters()
            batch: list[Any] = []
            for cidx in range(len(per_cluster)):
                batch += self.get_sample_from_cluster(cidx, int(per_cluster[cidx]))
            self.np_rng.shuffle(batch)
            padded = [int(x) for x in batch] + [-1] * (self.global_batch_size - len(batch))
            tensor = torch.tensor(padded, dtype=torch.long)
        else:
            tensor = torch.empty(self.global_batch_size, dtype=torch.long)
        self._broadcast(tensor)
        self.batch = tensor[tensor != -1].tolist()

    def _distributed(self) -> bool:
        return self.data_parallel_size > 1 and tdist.is_available() and tdist.is_initialized()

    def _broadcast_flag(self, flag: bool) -> bool:
        """The leader's `flag`, on every rank of the data-parallel group."""
        if not self._distributed():
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.long)
        self._broadcast(tensor)
        return bool(tensor.item())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if not self._distributed():
            return
        group = self.data_parallel_group
        src = tdist.get_global_rank(group, 0) if group is not None else 0
        if tdist.get_backend(group) == "nccl":
            moved = tensor.cuda()
            tdist.broadcast(moved, src, group=group)
            tensor.copy_(moved.cpu())
        else:
            tdist.broadcast(tensor, src, group=group)

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
                if not self.batch:
                    return
            current = self.batch[: self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size :]
            if len(current) == self.micro_batch_times_data_parallel_size or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                # counted before the yield, so a state saved after this batch was used resumes after it
                self.consumed_samples += len(current)
                yield current[start:end]

    # -- state --------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": self.current_difficulties,
            "data_cluster_paths": self.data_cluster_paths,
            "data_cluster_current_position": self.data_cluster_current_position,
            "np_rng_state": np.random.get_state(),
            "sampler_rng_state": self.np_rng.bit_generator.state,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from `state_dict()` (ds's or DeepSpeed's); the cluster files are read from
        `data_cluster_path` by their names, so a moved cluster directory only needs the config changed."""
        self.batch = list(state_dict["batch"])
        self.consumed_samples = state_dict["consumed_samples"]
        self.curriculum_step = state_dict["curriculum_step"]
        self.current_difficulties = dict(state_dict["current_difficulties"])
        # older DeepSpeed checkpoints stored absolute paths; only the file name is kept
        self.data_cluster_paths = [p.split("/")[-1] for p in state_dict["data_cluster_paths"]]
        self.data_cluster_current_position = list(state_dict["data_cluster_current_position"])
        np.random.set_state(state_dict["np_rng_state"])
        if "sampler_rng_state" in state_dict:
            self.np_rng.bit_generator.state = state_dict["sampler_rng_state"]
        self.data_clusters, self.data_cluster_sizes = [], []
        if self.is_leader:
            for fname in self.data_cluster_paths:
                cluster = np.copy(MMapIndexedDataset(self._cluster_path(fname), skip_warmup=True)[0])
                self.data_clusters.append([cluster])
                self.data_cluster_sizes.append(len(cluster))
