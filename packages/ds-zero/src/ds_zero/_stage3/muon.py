"""Muon under ZeRO 3: each rank's gradient shards become its slices of the Muon update of the whole matrices.

Why a gather: Newton–Schulz orthogonalizes a whole weight matrix, and at stage 3 a rank holds only
`ceil(numel / N)` elements of each parameter's gradient and momentum. Every rank holds the same
parameters of a param group at the same offsets of its flat partition, so all-gathering a run of
that partition (gradient and momentum stacked, one collective) gives every rank the N shards of
each parameter in the run; concatenated in rank order and cut to `numel` they are the full matrix.
Each rank then computes `ds_ops.muon_update` on the full gradient and momentum (the same inputs
everywhere, so the results agree), keeps its own slice of the update in its gradient partition,
for `MuonWithAuxAdam` to apply with the group's lr and weight decay (each tile's master is marked
`muon_update_in_grad`), and its own slice of the advanced momentum in the optimizer state.

The gathers go sub-group (tile) by tile and, inside a tile, in runs of whole parameters of at most
`reduce_bucket_size` gathered elements, so the full matrices held at once stay bounded as DeepSpeed
bounds them. DeepSpeed 0.19.8 orthogonalizes each matrix on one rank and all-gathers the results;
here every rank orthogonalizes every matrix of a run instead, which trades that second gather for
repeated Newton–Schulz work.

The momentum is `state["momentum_buffer"]` of each tile's master, shaped like the tile, so
checkpoints carry it and re-partition it like any optimizer state; it always lives in memory (the
master's device), which is what `save_muon_momentum_buffer_in_memory` asks DeepSpeed for.

It runs after the gradients are unscaled, checked and clipped (as ds's stage 1/2 Muon does), so the
update comes from the same gradient a replicated run would give the optimizer; DeepSpeed 0.19.8
forms it before the norm and clips the update instead. A skipped (overflow) step never reaches it,
so the momentum is left alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_ops import muon_update
from ds_zero._params.partitioned_param import state_of

if TYPE_CHECKING:
    from ds_zero._stage3.partition import ShardPartition, ShardTile

logger = logging.getLogger(__name__)

__all__ = ["MuonShardUpdate"]


class MuonShardUpdate:
    """Turns the gradient partitions of the `use_muon` groups into this rank's slices of the Muon update.

    Args:
        optimizer: the base optimizer (its groups hold the tiles' masters; Muon groups have `use_muon`).
        partitions: the stage-3 optimizer's partitions, one per param group.
        group: the data-parallel process group.
        bucket_numel: most gathered elements (all ranks' shards of gradient and momentum) per collective;
            a larger parameter is gathered alone.
        comm_device: where the gathers run (None: where the gradient partition is; nccl needs the device).

    Raises:
        ValueError: a Muon group holds a parameter with fewer than 2 dims (named), or a parameter's
            `muon_num_heads` does not split its rows evenly (named).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        partitions: list[ShardPartition],
        group: ProcessGroup | None,
        *,
        bucket_numel: int,
        comm_device: torch.device | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.group = group
        self.world = ds_comm.get_world_size(group)
        self.rank = ds_comm.get_rank(group)
        self.bucket_numel = max(1, int(bucket_numel))
        self.comm_device = comm_device
        self.partitions = [p for p in partitions if optimizer.param_groups[p.group_index].get("use_muon", False)]
        for part in self.partitions:
            _check_matrices(part)
            for tile in part.tiles:
                tile.master.muon_update_in_grad = True  # type: ignore[union-attr]  # the contract with MuonWithAuxAdam

    @property
    def active(self) -> bool:
        return any(part.params for part in self.partitions)

    def __call__(self) -> None:
        """Replace each Muon tile's gradient by this rank's slice of the update (collectives, in the same order)."""
        for part in self.partitions:
            grad = part.master.grad if part.master is not None else None
            if grad is None or not part.params:
                continue
            settings: dict[str, Any] = self.optimizer.param_groups[part.group_index]
            for tile in part.tiles:
                if tile.numel:
                    self._tile(tile, grad[tile.start : tile.end], settings)

    def _tile(self, tile: ShardTile, grad: torch.Tensor, settings: dict[str, Any]) -> None:
        state = self.optimizer.state[tile.master]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros(tile.numel, dtype=tile.master.dtype, device=tile.master.device)
        momentum = state["momentum_buffer"]
        for first, last in self._runs(tile):
            self._run(tile, first, last, grad, momentum, settings)

    def _runs(self, tile: ShardTile) -> list[tuple[int, int]]:
        """Consecutive parameter index ranges of `tile`, each gathered in one collective."""
        runs, first, total = [], 0, 0
        for i, p in enumerate(tile.params):
            size = 2 * self.world * state_of(p).shard_numel
            if i > first and total + size > self.bucket_numel:
                runs.append((first, i))
                first, total = i, 0
            total += size
        if first < len(tile.params):
            runs.append((first, len(tile.params)))
        return runs

    def _run(
        self,
        tile: ShardTile,
        first: int,
        last: int,
        grad: torch.Tensor,
        momentum: torch.Tensor,
        settings: dict[str, Any],
    ) -> None:
        params = tile.params[first:last]
        lo = tile.offsets[first]
        hi = tile.offsets[last - 1] + state_of(params[-1]).shard_numel
        device = self.comm_device or grad.device
        local = torch.stack([grad[lo:hi], momentum[lo:hi]]).to(device=device, dtype=torch.float32)
        gathered = torch.empty((self.world, 2, hi - lo), dtype=torch.float32, device=device)
        if self.world == 1:
            gathered[0].copy_(local)
        else:
            ds_comm.all_gather_into_tensor(gathered.view(-1), local.reshape(-1).contiguous(), group=self.group)
        for p, off in zip(params, tile.offsets[first:last], strict=True):
            shard = state_of(p).shard_numel
            at = off - lo
            full_grad = gathered[:, 0, at : at + shard].reshape(-1)[: p.ds_numel].view(p.ds_shape)
            full_momentum = gathered[:, 1, at : at + shard].reshape(-1)[: p.ds_numel].view(p.ds_shape)
            update = muon_update(
                full_grad,
                full_momentum,
                beta=settings.get("momentum", 0.95),
                ns_steps=settings.get("ns_steps", 5),
                num_heads=getattr(p, "muon_num_heads", None),
            )
            start = min(self.rank * shard, p.ds_numel)
            count = max(0, min(shard, p.ds_numel - start))
            with torch.no_grad():
                grad[off : off + count].copy_(update.reshape(-1)[start : start + count])
                grad[off + count : off + shard].zero_()
                momentum[off : off + count].copy_(full_momentum.reshape(-1)[start : start + count])


def _check_matrices(part: ShardPartition) -> None:
    flat = [f"{state_of(p).name} {tuple(p.ds_shape)}" for p in part.params if len(p.ds_shape) < 2]
    if flat:
        raise ValueError(
            f"param group {part.group_index} has use_muon=True but holds parameters with fewer than 2 dims "
            f"({', '.join(flat)}); Muon updates matrices only"
        )
    for p in part.params:
        heads = getattr(p, "muon_num_heads", None)
        if heads is not None and (len(p.ds_shape) != 2 or p.ds_shape[0] % heads):
            raise ValueError(
                f"{state_of(p).name}: muon_num_heads={heads} does not split the rows of its {tuple(p.ds_shape)} "
                "matrix into equal heads; set muon_num_heads to a divisor of the output dim or None"
            )
