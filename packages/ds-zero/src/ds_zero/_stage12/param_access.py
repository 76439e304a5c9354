"""Stage 1/2: one parameter's fp32 master, gradient and optimizer state, whole or as this rank's fragment.

A parameter occupies `[flat_offset, flat_offset + numel)` of its group's flat buffer; this rank owns
the partition `[rank * P, (rank + 1) * P)`, so it holds the fragment of the parameter that falls in its
partition (possibly none, possibly all of it). The whole fp32 value is every rank's fragment placed in
a zero tensor and summed over the data-parallel group (the fragments tile the parameter, so the sum is
exact); a new whole value is written by each rank into its own fragment.

Gradients: at stage 2 the averaged fp32 gradient fragments are in the optimizer's gradient partitions
right after backward. Stage 1 reduces at `step()`, so between backward and step each rank still holds
its own full gradient in `.grad`: the whole averaged gradient is the mean of those over the group, and a
new whole gradient is written into `.grad` on every rank (the step's reduction then averages identical
values). Either way gradients exist only between backward and step, scaled by the loss scale (fp16), as
in DeepSpeed. The per-partition ("local") accessors are ZeRO-3's only, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import ds_comm
from ds_zero._param_access import check_numel, state_tensor
from ds_zero._partition import ParamSlot
from ds_zero._stage12.flat_buffer import FlatParamGroup
from ds_zero._stage12.reduce import BoundaryReducer

__all__ = ["PartitionParamAccess"]


class PartitionParamAccess:
    """DeepSpeed's per-parameter accessors (the stage-3 optimizer's method names) for `DeepSpeedZeroOptimizer`.

    The whole-value methods are collectives over the data-parallel group: every rank calls them, for
    the same parameters in the same order. Parameters this optimizer does not train give None (getters)
    or are left alone (setters).
    """

    # provided by DeepSpeedZeroOptimizer
    flats: list[FlatParamGroup]
    masters: list[torch.Tensor]
    grad_partitions: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    dp_group: Any
    dp_world_size: int
    partition_groups: list[Any]
    zero_stage: int
    offload: bool
    coalescing_grad_reduction: bool
    _grads: Any

    def _group_of(self, g: int) -> tuple[Any, int]:
        """The process group param group `g` is partitioned over (an MoE expert group's own) and its size."""
        group = self.partition_groups[g]
        return group, ds_comm.get_world_size(group)

    def _slot_of(self, param: torch.Tensor) -> tuple[int, ParamSlot] | None:
        index: dict[int, tuple[int, ParamSlot]] | None = self.__dict__.get("_slot_index")
        if index is None:
            index = {
                id(p): (g, slot)
                for g, flat in enumerate(self.flats)
                for p, slot in zip(flat.params, flat.slots, strict=True)
            }
            self.__dict__["_slot_index"] = index
        return index.get(id(param))

    def _own_piece(self, g: int, slot: ParamSlot) -> tuple[int, int, int] | None:
        """(start in the parameter, elements, start in this rank's partition) of this rank's fragment."""
        flat = self.flats[g]
        lo = max(slot.flat_offset, flat.own_start)
        hi = min(slot.flat_end, flat.own_start + flat.partition_numel)
        if lo >= hi:
            return None
        return lo - slot.flat_offset, hi - lo, lo - flat.own_start

    def _gather(self, g: int, slot: ParamSlot, partition: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(slot.numel, dtype=torch.float32, device=self.flats[g].device)
        piece = self._own_piece(g, slot)
        if piece is not None:
            start, n, at = piece
            full[start : start + n].copy_(partition[at : at + n])
        group, world = self._group_of(g)
        if world > 1:
            ds_comm.all_reduce(full, group=group)
        return full.view(slot.shape)

    def _scatter(self, value: torch.Tensor, g: int, slot: ParamSlot, partition: torch.Tensor, what: str) -> None:
        flat_value = check_numel(value, slot.numel, what)
        piece = self._own_piece(g, slot)
        if piece is not None:
            start, n, at = piece
            with torch.no_grad():
                partition[at : at + n].copy_(flat_value[start : start + n])

    def _hp_partition(self, g: int, key: str | None, what: str) -> torch.Tensor:
        master = self.masters[g]
        return master if key is None else state_tensor(self.optimizer, master, key, what)

    # ------------------------------------------------------------------------------ fp32 master, optimizer state
    def get_full_hp_param(self, param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor | None:
        """The whole fp32 master value of `param` (or its optimizer state `optim_state_key`); a collective."""
        found = self._slot_of(param)
        if found is None:
            return None
        g, slot = found
        return self._gather(g, slot, self._hp_partition(g, optim_state_key, f"parameter {slot.name!r}"))

    def set_full_hp_param(self, value: torch.Tensor, param: torch.Tensor, optim_state_key: str | None = None) -> None:
        """Set `param`'s fp32 master (or optimizer state) from its whole new `value`; every rank passes the same.

        A new master value also goes into the model's weights at once (see the
        [Note: a new fp32 master reaches the model's weights at once] in `ds_zero._param_access`).
        """
        found = self._slot_of(param)
        if found is None:
            return
        g, slot = found
        what = f"parameter {slot.name!r}"
        self._scatter(value, g, slot, self._hp_partition(g, optim_state_key, what), what)
        if optim_state_key is None:
            with torch.no_grad():
                param.copy_(value.reshape(slot.shape))

    # ------------------------------------------------------------------------------------------- gradients
    def _require_gradients(self, slot: ParamSlot) -> None:
        if not self._grads.has_gradients:
            raise ValueError(
                f"parameter {slot.name!r}: ZeRO stage {self.zero_stage} gradients are only available between "
                "backward and the optimizer step"
            )

    def _stage1_unreduced(self) -> bool:
        """Stage 1 before its reduction: each rank still holds its own full gradients (after it, e.g. once
        `_get_norm_groups()` reduced the window, the partitions are read as at stage 2)."""
        return isinstance(self._grads, BoundaryReducer) and not self._grads.reduced

    def _stage1_grad(self, param: torch.Tensor, g: int, slot: ParamSlot) -> torch.Tensor:
        """This rank's own (not yet reduced) gradient of `param` at stage 1, bound to the flat gradient buffer."""
        grads: BoundaryReducer = self._grads
        if param.grad is None:
            view = self.flats[g].slot_view(grads.flat_grads[g], slot)
            view.zero_()
            param.grad = view
        return param.grad

    def get_fp32_grad_for_param(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole averaged fp32 gradient of `param` (between backward and step); a collective.

        Inside `coalesce_grad_reduction()` nothing is reduced yet: as DeepSpeed documents for that block, this
        returns the parameter's local, accumulated `.grad` itself (no collective, not averaged).
        """
        found = self._slot_of(param)
        if found is None:
            return None
        if self.coalescing_grad_reduction and param.grad is not None:
            return param.grad
        g, slot = found
        self._require_gradients(slot)
        if self._stage1_unreduced():
            full = self._stage1_grad(param, g, slot).detach().to(torch.float32, copy=True)
            group, world = self._group_of(g)
            if world > 1:
                ds_comm.all_reduce(full, group=group)
            if self.dp_world_size > 1:
                full.div_(self.dp_world_size)  # averaged over data parallel, as the reduction does
            return full
        return self._gather(g, slot, self.grad_partitions[g])

    def set_fp32_grad_for_param(self, value: torch.Tensor, param: torch.Tensor) -> None:
        """Replace `param`'s whole averaged gradient by `value` (between backward and step; same value on all ranks)."""
        found = self._slot_of(param)
        if found is None:
            return
        g, slot = found
        what = f"parameter {slot.name!r}"
        self._require_gradients(slot)
        if self._stage1_unreduced():
            flat_value = check_numel(value, slot.numel, what)
            with torch.no_grad():
                self._stage1_grad(param, g, slot).copy_(flat_value.view(slot.shape))
            return
        self._scatter(value, g, slot, self.grad_partitions[g], what)

    def update_fp32_grad_for_param_vectorized(
        self, update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], param_list: list[torch.Tensor]
    ) -> None:
        """For each trained parameter: gradient = `update_func(whole averaged gradient, param)`; a collective."""
        for p in param_list:
            full = self.get_fp32_grad_for_param(p)
            if full is not None:
                self.set_fp32_grad_for_param(update_func(full, p), p)

    @property
    def accumulated_grads_in_cpu(self) -> dict[int, torch.Tensor]:
        """DeepSpeed's name: with optimizer offload, the gradients accumulated in host memory so far this window.

        Per parameter with a fragment in this rank's partition, keyed by its index over the param groups
        in order (DeepSpeed's param id): that fragment of the host fp32 gradient partition, a flat view
        (reads see later micro-steps; averaged over the data-parallel group, scaled by the loss scale).
        Empty without offload, and while the window holds nothing on the host: before the first backward
        after a step and, at stage 1 (which reduces at `step()`), until its reduction. ds accumulates
        straight into the fp32 partitions the step reads, so unlike DeepSpeed there is no second host
        buffer; these are views of those partitions.
        """
        if not self.offload or not self._host_holds_window():
            return {}
        out: dict[int, torch.Tensor] = {}
        index = 0
        for g, flat in enumerate(self.flats):
            for slot in flat.slots:
                piece = self._own_piece(g, slot)
                if piece is not None:
                    _, n, at = piece
                    out[index] = self.grad_partitions[g][at : at + n]
                index += 1
        return out

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """DeepSpeed's name: per param group, this rank's reduced gradient fragment of each parameter with a
        fragment in its partition, in order (views of the gradient partition the step reads; averaged over the
        data-parallel group, scaled by the loss scale).

        Filled from a backward's reduction until the step, as DeepSpeed's is at the accumulation boundary.
        Empty otherwise: before the first backward and after the step; with optimizer offload (DeepSpeed's
        stays empty there too, its gradients go to the host copy: `accumulated_grads_in_cpu`); and at stage 1
        until its reduction, which ds runs at `step()` (or `_get_norm_groups()`) where DeepSpeed runs it at
        the boundary backward; reading this never reduces.
        """
        if self.offload or not self._grads.has_gradients or self._stage1_unreduced():
            return {}
        out: dict[int, list[torch.Tensor]] = {}
        for g, flat in enumerate(self.flats):
            pieces = []
            for slot in flat.slots:
                piece = self._own_piece(g, slot)
                if piece is not None:
                    _, n, at = piece
                    pieces.append(self.grad_partitions[g][at : at + n])
            out[g] = pieces
        return out

    def _host_holds_window(self) -> bool:
        if isinstance(self._grads, BoundaryReducer):
            return self._grads.reduced
        return self._grads.has_gradients

    # ------------------------------------------------------------------------------------ local (ZeRO-3 only)
    def _not_partitioned(self, what: str) -> ValueError:
        return ValueError(
            f"{what} is defined for ZeRO-3 partitioned parameters only; at stage {self.zero_stage} each rank "
            "holds a fragment of a flat buffer, not a partition of each parameter: use the full accessors "
            "(safe_get_full_fp32_param, safe_get_full_grad, ...)"
        )

    def get_local_fp32_param(self, param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor | None:
        raise self._not_partitioned("the local fp32 parameter / optimizer state")

    def set_local_hp_param(self, value: torch.Tensor, param: torch.Tensor, optim_state_key: str | None = None) -> None:
        raise self._not_partitioned("the local fp32 parameter / optimizer state")

    def get_local_fp32_grad_for_param(self, param: torch.Tensor) -> torch.Tensor | None:
        raise self._not_partitioned("the local gradient")

    def set_local_grad_for_param(self, value: torch.Tensor, param: torch.Tensor) -> None:
        raise self._not_partitioned("the local gradient")
