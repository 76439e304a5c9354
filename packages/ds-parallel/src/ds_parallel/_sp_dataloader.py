"""`UlyssesSPDataLoaderAdapter`: a DataLoader's batches as sequence shards for an SP group.

The batch each rank gets has DeepSpeed's contents: every `[batch, seq]` tensor cut to this rank's 1/P of
the sequence, `labels` replaced by `shift_labels` (the targets shifted left by one on the WHOLE sequence,
`-100` last, so the token at a shard's end keeps the next shard's first token as its target), and the
rest (`position_ids`, `attention_mask`, non-tensors) kept. Without `labels` in the batch HF's forward
computes no loss: the loss is computed from `shift_labels` (`model.loss_function(logits=..., labels=None,
shift_labels=...)`) and combined across the SP group weighted by each shard's count of real targets.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm

__all__ = ["UlyssesSPDataLoaderAdapter"]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


class UlyssesSPDataLoaderAdapter:
    """Wrap a DataLoader so each SP group processes its ranks' batches one after another, sequence-sharded.

    Every rank of an SP group loads its own batch (the loader is sharded over all ranks as usual). On each
    refill the adapter gathers the group's batches; the next P `next()` calls then yield, for each of them
    in rank order, this rank's 1/P slice along the sequence (dim 1) of every tensor. So the adapter yields
    P micro-batches per batch of the wrapped loader (`len()` says so). It is its own iterator: `iter()`
    returns it and iteration continues where it stopped; when the wrapped loader ends, `StopIteration`
    is raised once and the next iteration starts a new epoch.

    Each yielded batch holds, for keys of the loaded batch: the tensors sliced (`labels` becomes
    `shift_labels`, see the module doc), non-tensors as the loading rank had them. `position_ids` are
    made (`0..seq-1` per sample) when the batch has none; pass them for packed samples.

    Args:
        dl: the DataLoader (or any iterable of dicts of `[batch, seq, ...]` tensors with `input_ids` and
            `labels`).
        sp_rank, sp_group, sp_world_size: this rank in the sequence-parallel group.
        device: where the yielded tensors go.
    """

    def __init__(
        self, dl: Any, sp_rank: int, sp_group: ProcessGroup, sp_world_size: int, device: torch.device | str
    ) -> None:
        self.dl, self.sp_rank, self.sp_group = dl, sp_rank, sp_group
        self.sp_world_size, self.device = sp_world_size, torch.device(device)
        self.iter: Iterator[Any] = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Load this rank's next batch, gather the SP group's, and queue this rank's shard of each."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next iteration is a new epoch
            raise
        mine = _check_batch(batch)
        gathered: list[Any] = [None] * self.sp_world_size
        ds_comm.all_gather_object(gathered, mine, group=self.sp_group)
        for sample in gathered:
            self.micro_batches.append(self._shard(sample))

    def _shard(self, batch: dict[str, Any]) -> dict[str, Any]:
        seq = batch["input_ids"].size(1)
        if seq % self.sp_world_size:
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: sequence length {seq} is not a multiple of the "
                f"sequence-parallel size {self.sp_world_size}; pad the batch to a multiple"
            )
        batch = dict(batch)
        if "position_ids" not in batch:
            bs = batch["input_ids"].size(0)
            batch["position_ids"] = torch.arange(seq).expand(bs, seq)
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        chunk = seq // self.sp_world_size
        lo, hi = self.sp_rank * chunk, (self.sp_rank + 1) * chunk
        return {
            key: value[:, lo:hi].contiguous().to(self.device) if torch.is_tensor(value) else value
            for key, value in batch.items()
        }


def _check_batch(batch: Any) -> dict[str, Any]:
    """This rank's batch on the CPU, after checking it can be sharded: dicts with input_ids and labels,
    every tensor `[batch, seq, ...]` with input_ids' sequence length."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise TypeError(
            f"UlyssesSPDataLoaderAdapter: batches must be dicts with 'input_ids', got {type(batch).__name__}"
        )
    if "labels" not in batch:
        raise ValueError(
            "UlyssesSPDataLoaderAdapter: the batch has no 'labels'; the adapter turns them into the "
            "pre-shifted 'shift_labels' each shard's loss needs, so the loader must return them"
        )
    ids = batch["input_ids"]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.size(1) != ids.size(1)):
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: {key}'s shape {tuple(value.shape)} must match input_ids's "
                f"shape {tuple(ids.shape)} in the sequence dimension (dim 1) to be sharded along it"
            )
    return {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
