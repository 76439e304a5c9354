"""`CurriculumDataLoader`: the training loader under curriculum learning, driven by `DeepSpeedDataSampler`.

The sampler is the loader's batch sampler: each batch is this rank's share of the next micro batch the
curriculum draws. A post-processing function set with `engine.set_data_post_process_func(fn)` sees every
batch with the sampler's state (`fn(batch, sampler.state_dict())`), which holds the current difficulties,
so it can, for instance, truncate sequences to the current sequence-length difficulty.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from ds_engine._data.sampler import DeepSpeedDataSampler

logger = logging.getLogger(__name__)

__all__ = ["CurriculumDataLoader"]


class CurriculumDataLoader:
    """Iterates `dataset` in the batches `data_sampler` draws (see the module docstring).

    `len()` is the number of micro batches of `batch_size` the sampler's total samples make (rounded up
    unless `drop_last`), as DeepSpeed's loader reports it.
    """

    def __init__(
        self,
        dataset: Any,
        data_sampler: DeepSpeedDataSampler,
        *,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        num_workers: int,
        pin_memory: bool,
        drop_last: bool,
    ) -> None:
        self.dataset = dataset
        self.data_sampler = data_sampler
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.num_local_io_workers = num_workers
        self.pin_memory = pin_memory
        self.dataloader_drop_last = drop_last
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None
        n = len(data_sampler)
        self.len = n // batch_size if drop_last else -(-n // batch_size)
        self.dataloader: DataLoader[Any] | None = None
        self.data_iterator: Iterator[Any] | None = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self) -> CurriculumDataLoader:
        kwargs: dict[str, Any] = {}
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        self.dataloader = DataLoader(
            self.dataset,
            batch_sampler=self.data_sampler,  # an iterable of index lists
            num_workers=self.num_local_io_workers,
            pin_memory=self.pin_memory,
            **kwargs,
        )
        self.data_iterator = iter(self.dataloader)
        return self

    def __next__(self) -> Any:
        if self.data_iterator is None:
            iter(self)
        assert self.data_iterator is not None
        data = next(self.data_iterator)
        if self.post_process_func is not None:
            data = self.post_process_func(data, self.data_sampler.state_dict())
        return data
