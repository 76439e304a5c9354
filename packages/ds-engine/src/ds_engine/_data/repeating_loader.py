"""`RepeatingLoader` (DeepSpeed's `deepspeed.runtime.dataloader`): endless iteration over a finite loader.

Pipeline training draws `gradient_accumulation_steps` micro-batches per `train_batch`, with no
notion of epochs; wrapping the loader lets a script keep calling `next()` across epoch ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["RepeatingLoader"]

T = TypeVar("T")


class RepeatingLoader(Generic[T]):
    """An iterator over `loader` that starts `iter(loader)` again whenever it is exhausted.

    Each restart calls `iter(loader)` afresh, so a `DataLoader` with `shuffle=True` (or a sampler
    with `set_epoch`) gives a new order every pass. `loader` stays reachable as `.loader`.

    Raises (from `next`):
        ValueError: `loader` yields nothing at all (an endless loop would follow otherwise).
    """

    def __init__(self, loader: Iterable[T]) -> None:
        self.loader = loader
        self.data_iter: Iterator[T] = iter(loader)

    def __iter__(self) -> RepeatingLoader[T]:
        return self

    def __next__(self) -> T:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
        try:
            return next(self.data_iter)
        except StopIteration:
            raise ValueError(f"RepeatingLoader: {self.loader!r} yields no items; it cannot be repeated") from None

    def __repr__(self) -> str:
        return f"RepeatingLoader({self.loader!r})"
