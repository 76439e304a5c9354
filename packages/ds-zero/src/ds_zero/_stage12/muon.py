"""Muon under ZeRO 1/2: each rank's partition gets its slice of the Muon update of the whole matrices.

Why a gather: Newton–Schulz orthogonalizes a whole weight matrix, and a rank's flat partition holds
arbitrary slices of matrices (a matrix may straddle two partitions). As in DeepSpeed, the reduced
gradient partitions of a Muon group are all-gathered into the full flat gradient, and the Muon
momentum, kept partitioned like any optimizer state (`state["momentum_buffer"]` of the group's master
partition, so checkpoints carry it), is gathered with it. Every matrix overlapping this rank's
partition is then updated with `ds_ops.muon_update` on its full gradient and momentum (identical
inputs on every rank that computes it, so the overlapping slices agree), and this rank keeps its own
slice: the update goes into the partition's gradient, for `MuonWithAuxAdam` to apply with the group's
lr and weight decay (the master partition is marked `muon_update_in_grad`), and the advanced momentum
into the state.

It runs after the gradients are unscaled, checked and clipped, so the Muon update is computed from
the same (clipped) gradient a replicated run would give the optimizer; DeepSpeed 0.19.8 instead
forms the update while partitioning, before the norm, and clips the update.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_ops import muon_update
from ds_zero._stage12.flat_buffer import FlatParamGroup

logger = logging.getLogger(__name__)

__all__ = ["MuonPartitionUpdate"]


class MuonPartitionUpdate:
    """Turns the gradient partitions of the `use_muon` groups into this rank's slices of the Muon update.

    Args:
        optimizer: the base optimizer (its k-th group holds `[masters[k]]`; Muon groups have `use_muon`).
        flats: the flat parameter groups.
        masters: the fp32 master partitions (keys of the optimizer's state).
        group: the data-parallel process group.
        device: where the full gradients are gathered (the flat buffers' device: on nccl a host
            tensor cannot be gathered).

    Raises:
        ValueError: a Muon group holds a parameter with fewer than 2 dims (named).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        flats: list[FlatParamGroup],
        masters: list[torch.Tensor],
        group: ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.flats = flats
        self.masters = masters
        self.group = group
        self.device = device
        self.world = ds_comm.get_world_size(group)
        self.groups = [k for k, g in enumerate(optimizer.param_groups) if g.get("use_muon", False)]
        for k in self.groups:
            flat = [s for s in flats[k].slots if len(s.shape) < 2]
            if flat:
                raise ValueError(
                    f"param group {k} has use_muon=True but holds parameters with fewer than 2 dims "
                    f"({', '.join(f'{s.name} {s.shape}' for s in flat)}); Muon updates matrices only"
                )
            masters[k].muon_update_in_grad = True  # type: ignore[attr-defined]  # the contract with ds_ops.MuonWithAuxAdam

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def __call__(self, grads: list[torch.Tensor]) -> None:
        """Replace `grads[k]` of each Muon group by this rank's slice of the update (a collective)."""
        for k in self.groups:
            self._group(k, grads[k])

    def _gather(self, part: torch.Tensor, padded_numel: int) -> torch.Tensor:
        full = torch.empty(padded_numel, dtype=torch.float32, device=self.device)
        local = part.to(device=self.device, dtype=torch.float32)
        if self.world == 1:
            full.copy_(local)
        else:
            ds_comm.all_gather_into_tensor(full, local.contiguous(), group=self.group)
        return full

    def _group(self, k: int, grad_part: torch.Tensor) -> None:
        flat, master = self.flats[k], self.masters[k]
        settings: dict[str, Any] = self.optimizer.param_groups[k]
        state = self.optimizer.state[master]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(master)
        momentum = state["momentum_buffer"]
        full_grad = self._gather(grad_part, flat.padded_numel)
        full_momentum = self._gather(momentum, flat.padded_numel)
        lo, hi = flat.own_start, flat.own_start + flat.partition_numel
        for param, slot in zip(flat.params, flat.slots, strict=True):
            if slot.flat_end <= lo or slot.flat_offset >= hi or slot.numel == 0:
                continue  # another rank's matrix: its owners compute it
            grad = flat.slot_view(full_grad, slot)
            update = muon_update(
                grad,
                flat.slot_view(full_momentum, slot),
                beta=settings.get("momentum", 0.95),
                ns_steps=settings.get("ns_steps", 5),
                num_heads=getattr(param, "muon_num_heads", None),
            )
            grad.copy_(update)
        with torch.no_grad():
            grad_part.copy_(full_grad[lo:hi])
            momentum.copy_(full_momentum[lo:hi])
