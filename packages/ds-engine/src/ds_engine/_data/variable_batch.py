"""Dynamic batching: pack sequences into micro batches of at most `max_tokens`, and scale the lr per batch.

`batch_by_seqlens` walks the samples (in dataloader, random or ascending-length order), drops those longer
than `max_tokens` on their own, and cuts the rest into micro batches of consecutive samples, each as long
as its token sum, `min_batch_size` and `max_batch_size` allow. With `required_microbatches_of_same_size`
(pipeline engines), `effective_batch_size` micro batches are cut at once from interleaved samples, so
they hold equally many sequences. Every `effective_batch_size` micro batches form one batch; the number
of sequences in it is that batch's size, from which `VariableBatchSizeLR` scales the lr of the step
(linearly or by the square root, relative to `base_batch_size`).

The packing, its quirks included (the last sample of the walk is never packed; a trailing partial batch
is dropped), the random order for a seed and the lr sequence are DeepSpeed 0.19.8's, so the same lengths
and settings give the same batches and lrs on both sides.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from torch import Tensor
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import Optimizer
from torch.utils.data import DataLoader, Dataset, DistributedSampler

logger = logging.getLogger(__name__)

__all__ = [
    "PICKING_ORDERS",
    "VariableBatchSizeLR",
    "batch_by_seqlens",
    "dataloader_for_variable_batch_size",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size",
    "lr_scheduler_for_variable_batch_size",
    "scale_lr",
]

PICKING_ORDERS = ("dataloader", "random", "seqlen")


def batch_by_seqlens(
    seqlens: Sequence[int],
    max_tokens: int,
    sequence_ids_per_mb: Sequence[int] | None = None,
    min_batch_size: int | None = 1,
    max_batch_size: int | None = None,
    sequence_picking_order: str = "dataloader",
    effective_batch_size: int = 1,
    required_microbatches_of_same_size: bool = False,
    verbose: bool = False,
    seed: int | None = None,
) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    """Micro batches of sample ids whose summed `seqlens` stay within `max_tokens`.

    Args:
        seqlens: the length (any additive cost) of every sample of the dataset.
        sequence_ids_per_mb: only these samples (default: all), in this order.
        sequence_picking_order: "dataloader" (as given), "random" (shuffled with `seed`), "seqlen" (ascending).
        effective_batch_size: micro batches per batch (the lr is scaled per batch).

    Returns:
        `(microbatch_ids, batch_sizes, batch_max_seqlens)`: `(batch id, sample ids)` per micro batch, and per
        batch the number of sequences and the longest sequence.

    Raises:
        ValueError: an unknown picking order, or too few samples for one batch.
    """
    if sequence_picking_order not in PICKING_ORDERS:
        raise ValueError(f"sequence_picking_order is {sequence_picking_order!r}; use one of {PICKING_ORDERS}")
    if sequence_ids_per_mb is None:
        metrics = list(zip(seqlens, range(len(seqlens)), strict=False))
    else:
        metrics = list(zip(np.array(seqlens)[list(sequence_ids_per_mb)], sequence_ids_per_mb, strict=False))
    if sequence_picking_order == "random":
        random.Random(seed).shuffle(metrics)
    elif sequence_picking_order == "seqlen":
        metrics = sorted(metrics)
    too_long = {idx for val, idx in metrics if val > max_tokens}
    if too_long:
        logger.warning("samples %s are left out: each alone exceeds max_tokens %d", sorted(too_long), max_tokens)
        metrics = [m for m in metrics if m[1] not in too_long]

    def fits_max(mb: list[Any]) -> bool:
        return not (max_batch_size and len(mb) > max_batch_size) and sum(m[0] for m in mb) <= max_tokens

    def fits_min(mb: list[Any]) -> bool:
        return not (min_batch_size and len(mb) < min_batch_size)

    group = effective_batch_size if required_microbatches_of_same_size else 1
    microbatches: list[list[Any]] = []
    start = 0
    while start < len(metrics):
        # Grow the group `group` samples at a time (each micro batch gains one); the end stays below the
        # last sample. Growing only adds, so once a micro batch is over a maximum, every longer cut is too.
        best = start
        for end in range(start + group, len(metrics), group):
            mbs = [metrics[start:end][b::group] for b in range(group)]
            if not all(fits_max(mb) for mb in mbs):
                break
            if all(fits_min(mb) for mb in mbs):
                best = end
        if best == start:
            break
        microbatches += [metrics[start:best][b::group] for b in range(group)]
        start = best
    if len(microbatches) < effective_batch_size:
        raise ValueError(
            f"dynamic batching: {len(microbatches)} micro batches fit max_tokens {max_tokens}, fewer than the "
            f"{effective_batch_size} one batch needs"
        )
    microbatches = microbatches[: len(microbatches) - len(microbatches) % effective_batch_size]
    microbatch_ids: list[tuple[int, list[int]]] = []
    batch_sizes: list[int] = []
    batch_max_seqlens: list[int] = []
    for batch_id, first in enumerate(range(0, len(microbatches), effective_batch_size)):
        mbs = microbatches[first : first + effective_batch_size]
        batch_sizes.append(sum(len(mb) for mb in mbs))
        batch_max_seqlens.append(max(m[0] for mb in mbs for m in mb))
        microbatch_ids += [(batch_id, [m[1] for m in mb]) for mb in mbs]
        if verbose:
            logger.info(
                "batch %d: %d micro batches, %d sequences; sequences per micro batch %s, tokens %s, ids %s",
                batch_id,
                len(mbs),
                batch_sizes[-1],
                [len(mb) for mb in mbs],
                [sum(m[0] for m in mb) for mb in mbs],
                [[m[1] for m in mb] for mb in mbs],
            )
    return microbatch_ids, batch_sizes, batch_max_seqlens


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1, method: str | None = "linear") -> float:
    """The lr for `batch_size` given `base_lr` at `base_batch_size`: "linear" (Goyal et al.), "sqrt"
    (Krizhevsky) or "none"/None (unchanged)."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or method.upper() == "NONE":
        return base_lr
    raise ValueError(f"lr scaling method {method!r} is not one of 'linear', 'sqrt', 'none'")


def dataloader_for_variable_batch_size(
    dataset: Any,
    microbatch_ids: Sequence[tuple[int, list[int]]],
    batch_max_seqlens: Sequence[int],
    dataloader_rank: int = 0,
    dataloader_batch_size: int = 1,
    dataloader_num_replicas: int = 1,
    dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
    dataloader_num_workers: int = 2,
    dataloader_pin_memory: bool = False,
    required_microbatches_of_same_seqlen: bool = False,
    sample_padding_fn: Callable[[Any, int], Any] | None = None,
) -> tuple[DataLoader[Any], dict[str, Any]]:
    """A loader over the micro batches (interleaved across `dataloader_num_replicas`), each item the
    collated samples of `dataloader_batch_size` micro batches; and the same as `deepspeed_io` kwargs.

    With `required_microbatches_of_same_seqlen`, every sample is padded by `sample_padding_fn(sample,
    length)` to its batch's longest sequence.
    """
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise ValueError("required_microbatches_of_same_seqlen needs sample_padding_fn(sample, max_seqlen)")
    # A sequence is a map-style dataset (__getitem__ and __len__), which is all the sampler and loader use.
    ids_dataset = cast("Dataset[tuple[int, list[int]]]", microbatch_ids)
    sampler: DistributedSampler[tuple[int, list[int]]] = DistributedSampler(
        ids_dataset, num_replicas=dataloader_num_replicas, rank=dataloader_rank, shuffle=False, drop_last=False
    )

    def collate(items: list[tuple[int, list[int]]]) -> Any:
        samples: list[Any] = []
        for batch_id, ids in items:
            data = [dataset[i] for i in ids]
            if required_microbatches_of_same_seqlen:
                longest = batch_max_seqlens[batch_id]
                if any(len(s) > longest for s in data):
                    raise ValueError(f"a sample of batch {batch_id} is longer than its max seqlen {longest}")
                data = [sample_padding_fn(s, longest) for s in data]  # type: ignore[misc]
            samples += data
        return dataloader_collate_fn(samples) if dataloader_collate_fn else samples

    loader = DataLoader(
        ids_dataset,
        batch_size=dataloader_batch_size,
        sampler=sampler,
        num_workers=dataloader_num_workers,
        collate_fn=collate,
        pin_memory=dataloader_pin_memory,
    )
    io_kwargs = dict(
        dataset=microbatch_ids,
        batch_size=dataloader_batch_size,
        pin_memory=dataloader_pin_memory,
        data_sampler=sampler,
        collate_fn=collate,
        num_local_io_workers=dataloader_num_workers,
    )
    return loader, io_kwargs


class VariableBatchSizeLR(LRScheduler):
    """Wraps an lr scheduler: each step sets the wrapped schedule's lr, then scales it by that step's batch size.

    Step `k` (the lr used for batch `k`) is `scale_lr(base_batch_size, batch_sizes[k % len], lr_k)`, `lr_k`
    being the wrapped scheduler's own lr for step `k`. Construction applies step 0.
    """

    def __init__(
        self,
        lr_scheduler: Any,
        base_batch_size: int,
        batch_sizes: Sequence[int],
        dataloader: Any,
        lr_scaling_method: str = "linear",
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        # LRScheduler.__init__ is not called: the wrapped scheduler owns the optimizer's schedule state
        self.batch_sizes = list(batch_sizes)
        self.base_batch_size = base_batch_size
        self.lr_scaling_method = lr_scaling_method
        self.dataloader = dataloader
        self.base_lr_scheduler = lr_scheduler
        with warnings.catch_warnings():  # torch asks for get_last_lr(); the lrs before any step are wanted here
            warnings.filterwarnings("ignore", message="To get the last learning rate", category=UserWarning)
            self.base_lrs = self.base_lr_scheduler.get_lr()
        self.last_epoch = last_epoch
        self.verbose = verbose
        self.step(0)

    @property
    def optimizer(self) -> Optimizer:  # type: ignore[override]
        return self.base_lr_scheduler.optimizer

    def state_dict(self) -> dict[str, Any]:
        return {
            "base_lr_scheduler": self.base_lr_scheduler.state_dict(),
            "base_batch_size": self.base_batch_size,
            "lr_scaling_method": self.lr_scaling_method,
            "batch_sizes": self.batch_sizes,
            "base_lrs": self.base_lrs,
            "last_epoch": self.last_epoch,
            "verbose": self.verbose,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs", "last_epoch", "verbose"):
            setattr(self, key, state_dict[key])

    def get_last_lr(self) -> list[float | Tensor]:
        """The wrapped scheduler's last (unscaled) lrs."""
        return self.base_lr_scheduler._last_lr

    def get_lr(self) -> list[float | Tensor]:
        """The lrs in the optimizer now (scaled)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        """Advance to step `epoch` (the next one when None): the wrapped scheduler steps on the unscaled lrs,
        then the lrs are scaled for the batch of the new step. `step(0)` restarts from the base lrs."""
        unscaled = self.base_lrs if epoch == 0 else self.get_last_lr()
        for group, lr in zip(self.optimizer.param_groups, unscaled, strict=False):
            group["lr"] = lr
        with warnings.catch_warnings():  # step(epoch) is how the wrapped schedule is restarted at step 0
            warnings.filterwarnings("ignore", message="The epoch parameter", category=UserWarning)
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.base_lr_scheduler.step(epoch)
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        batch_size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for group in self.optimizer.param_groups:
            group["lr"] = scale_lr(self.base_batch_size, batch_size, group["lr"], self.lr_scaling_method)
        if self.verbose:
            logger.info(
                "step %d: batch size %d (reference %d), lr %s -> %s",
                self.last_epoch,
                batch_size,
                self.base_batch_size,
                unscaled,
                self.get_lr(),
            )


class _ConstantLR(LRScheduler):
    """Keeps the optimizer's lrs (the base for scaling when there is no scheduler)."""

    def get_lr(self) -> list[float | Tensor]:
        return list(self.base_lrs)


def lr_scheduler_for_variable_batch_size(
    base_batch_size: int,
    batch_sizes: Sequence[int],
    dataloader: Any,
    lr_scheduler_or_optimizer: Any,
    lr_scaling_method: str = "linear",
    verbose: bool = False,
) -> VariableBatchSizeLR:
    """A `VariableBatchSizeLR` over a scheduler, or over an optimizer's constant lrs.

    Raises:
        ValueError: `lr_scheduler_or_optimizer` is neither an optimizer nor has an `.optimizer`.
    """
    if isinstance(lr_scheduler_or_optimizer, Optimizer):
        scheduler = _ConstantLR(lr_scheduler_or_optimizer)
    elif isinstance(getattr(lr_scheduler_or_optimizer, "optimizer", None), Optimizer):
        scheduler = lr_scheduler_or_optimizer
    else:
        raise ValueError(
            f"lr_scheduler_or_optimizer must be a torch Optimizer or a scheduler with an .optimizer, got "
            f"{type(lr_scheduler_or_optimizer).__name__}"
        )
    return VariableBatchSizeLR(
        lr_scheduler=scheduler,
        base_batch_size=base_batch_size,
        batch_sizes=batch_sizes,
        dataloader=dataloader,
        lr_scaling_method=lr_scaling_method,
        verbose=verbose,
    )


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
    dataset: Any,
    dataset_seqlens: Sequence[int],
    max_tokens: int,
    effective_batch_size: int,
    dataset_filter_ids: Sequence[int] | None = None,
    lr_scaling_method: str = "linear",
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    sequence_picking_order: str = "dataloader",
    dataloader_batch_size: int = 1,
    dataloader_rank: int = 0,
    dataloader_num_replicas: int = 1,
    dataloader_num_workers: int = 0,
    dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
    dataloader_pin_memory: bool = False,
    lr_scheduler_or_optimizer: Any = None,
    required_microbatches_of_same_size: bool = False,
    required_microbatches_of_same_seqlen: bool = False,
    sample_padding_fn: Callable[[Any, int], Any] | None = None,
    verbose: bool = False,
    seed: int | None = None,
) -> tuple[DataLoader[Any], VariableBatchSizeLR, dict[str, Any]]:
    """`batch_by_seqlens`, then its loader and lr scheduler: `(dataloader, lr_scheduler, deepspeed_io_kwargs)`."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        seqlens=dataset_seqlens,
        max_tokens=max_tokens,
        sequence_ids_per_mb=dataset_filter_ids,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        sequence_picking_order=sequence_picking_order,
        effective_batch_size=effective_batch_size,
        required_microbatches_of_same_size=required_microbatches_of_same_size,
        verbose=verbose,
        seed=seed,
    )
    loader, io_kwargs = dataloader_for_variable_batch_size(
        dataset=dataset,
        microbatch_ids=microbatch_ids,
        batch_max_seqlens=batch_max_seqlens,
        dataloader_rank=dataloader_rank,
        dataloader_num_replicas=dataloader_num_replicas,
        dataloader_batch_size=dataloader_batch_size,
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_num_workers=dataloader_num_workers,
        dataloader_pin_memory=dataloader_pin_memory,
        required_microbatches_of_same_seqlen=required_microbatches_of_same_seqlen,
        sample_padding_fn=sample_padding_fn,
    )
    scheduler = lr_scheduler_for_variable_batch_size(
        base_batch_size=effective_batch_size,
        batch_sizes=batch_sizes,
        lr_scaling_method=lr_scaling_method,
        lr_scheduler_or_optimizer=lr_scheduler_or_optimizer,
        dataloader=loader,
        verbose=verbose,
    )
    return loader, scheduler, io_kwargs
