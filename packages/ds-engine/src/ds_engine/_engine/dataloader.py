"""`deepspeed_io`'s loader: the micro batch per rank, a DistributedSampler over the data-parallel ranks (or,
under curriculum learning, the curriculum sampler)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ds_comm import get_accelerator
from ds_engine._data.loader import CurriculumDataLoader
from ds_engine._data.sampler import DeepSpeedDataSampler
from ds_engine._plan.dist_info import DistInfo

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedDataLoader", "make_curriculum_loader", "make_dataloader"]


class DeepSpeedDataLoader(DataLoader):
    """A `DataLoader` whose batch is the micro batch and whose sampler shards the dataset across ranks.

    Call `set_epoch(epoch)` each epoch to reshuffle (it forwards to the DistributedSampler).
    """

    def set_epoch(self, epoch: int) -> None:
        sampler = self.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)


def make_dataloader(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    dp_world_size: int,
    dp_rank: int,
    pin_memory: bool,
    data_sampler: Sampler[Any] | None,
    collate_fn: Callable[..., Any] | None,
    num_workers: int,
    drop_last: bool,
    shuffle: bool = True,
) -> DeepSpeedDataLoader:
    """Build the loader; without a `data_sampler`, a `DistributedSampler` (shuffled, seed 0) over the DP ranks."""
    if data_sampler is None:
        data_sampler = DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle)
    return DeepSpeedDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=data_sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=pin_memory and get_accelerator().name != "cpu" and torch.cuda.is_available(),
    )


def make_curriculum_loader(
    dataset: Dataset[Any],
    *,
    data_efficiency_config: dict[str, Any],
    batch_size: int,
    dist: DistInfo,
    gradient_accumulation_steps: int,
    pin_memory: bool,
    collate_fn: Callable[..., Any] | None,
    drop_last: bool,
) -> CurriculumDataLoader:
    """The loader `deepspeed_io` builds under `data_efficiency.data_sampling.curriculum_learning.enabled`:
    a `DeepSpeedDataSampler` over the data-parallel ranks, with `data_sampling.num_workers` workers."""
    sampler = DeepSpeedDataSampler(
        data_efficiency_config,
        len(dataset),  # type: ignore[arg-type]  # a map-style dataset
        batch_size,
        dist.dp_rank,
        dist.dp_world_size,
        dist.dp_group,
        gradient_accumulation_steps,
        dist.global_rank,
        drop_last=drop_last,
    )
    return CurriculumDataLoader(
        dataset,
        sampler,
        batch_size=batch_size,
        collate_fn=collate_fn,
        num_workers=data_efficiency_config["data_sampling"]["num_workers"],
        pin_memory=pin_memory and get_accelerator().name != "cpu" and torch.cuda.is_available(),
        drop_last=drop_last,
    )
