"""`ZenFlowSelectiveAdamW_stage3`: Adam on selected rows of ZeRO-3 partitions, offloaded or not."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch

from ds_ops.adam._zenflow_base import SelectiveAdamWBase

__all__ = ["ZenFlowSelectiveAdamW_stage3"]


class ZenFlowSelectiveAdamW_stage3(SelectiveAdamWBase):  # noqa: N801 (DeepSpeed's name)
    """AdamW on the selected columns of ZeRO-3 parameters, in their partitions (DeepSpeed's class of that name).

    A ZeRO-3 parameter's values live in its flat partition `param.ds_tensor`, which ZenFlow lays out
    transposed: `param.ds_shape` is `(columns, rows)` of the original weight, so a column of the weight
    is a row of the partition. The whole rows this rank holds are the `param.complete_numel` elements
    from `param.complete_column_offset` on; `selected_indices` picks among them, and `selected_grad` has
    shape `(len(selected_indices), rows)`. A 1-D `ds_shape` (or one row wide) is updated whole.
    `group_step` takes a flat list and groups it by `param.group_id`.

    Offloaded partitions: the update runs on the gradient's device wherever the partition lives. A
    partition on CPU is read, updated on the gradient's device and written back; one swapped out to NVMe
    (`ds_tensor.data` is then a 0-dim placeholder) is swapped in through `param.nvme_swapper`, updated
    and swapped out again, one parameter at a time, and a snapshot (`temp_copy_param`) only reads it
    and releases it without writing back. If an update fails, a swapped-in partition is released
    without being written, so the copy on NVMe stays the last good one.

    The shared rules (inputs on each parameter, per-selection moments, offload of moments in buckets)
    are in `ds_ops.adam._zenflow_base`; arguments are `ZenFlowSelectiveAdamW`'s.
    """

    def temp_copy_param(self, paramlist: Iterable[torch.Tensor]) -> None:
        """Snapshot the selected rows of the given parameters' partitions into `param.temp_selected_param`."""
        self._snapshot(paramlist)

    @torch.no_grad()
    def group_step(self, paramlist: Sequence[torch.Tensor]) -> None:
        """Update the given parameters now, by param group (`param.group_id`); snapshots are not applied."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for param in paramlist:
            by_group.setdefault(int(param.group_id), []).append(param)
        for group_id in sorted(by_group):
            self._step_params(group_id, by_group[group_id], apply_temp=False)

    def _compute_device(self, param: torch.Tensor) -> torch.device:
        return param.selected_grad.device

    def _storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.ds_tensor.dtype

    @contextlib.contextmanager
    def _selected(self, param: torch.Tensor, *, device: torch.device | None, write: bool) -> Iterator[torch.Tensor]:
        swapped_in = self._swap_in_if_offloaded(param)
        try:
            data = param.ds_tensor.data
            if data.dim() == 0 and len(param.ds_shape) > 0:
                raise RuntimeError(
                    f"the ZeRO-3 partition of a parameter of shape {tuple(param.ds_shape)} is not resident "
                    "(a 0-dim placeholder) and it has no nvme_swapper to read it back"
                )
            device = data.device if device is None else device
            rows = self._rows(param, data)
            if rows is None:
                value = data if data.device == device else data.to(device)
                yield value
                if write and value is not data:
                    data.copy_(value)
            else:
                indices = param.selected_indices.to(data.device)
                value = rows.index_select(0, indices).to(device)
                yield value
                if write:
                    rows.index_copy_(0, indices, value.to(data.device))
        except BaseException:
            if swapped_in:  # drop the swapped-in copy unwritten: NVMe keeps the last good values
                param.nvme_swapper.remove_partition_and_release_buffers([param])
            raise
        if swapped_in:
            if write:
                param.nvme_swapper.swap_out_and_release([param])
            else:
                param.nvme_swapper.remove_partition_and_release_buffers([param])

    @staticmethod
    def _rows(param: torch.Tensor, data: torch.Tensor) -> torch.Tensor | None:
        """The whole rows of the partition as a `(n, row_numel)` view, or None when updated whole."""
        shape = tuple(param.ds_shape)
        row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
        if row_numel == 1:
            return None
        numel = int(param.complete_numel)
        if numel % row_numel:
            raise ValueError(
                f"complete_numel={numel} is not a whole number of rows of {row_numel} elements (ds_shape {shape})"
            )
        return data.narrow(0, int(param.complete_column_offset), numel).view(numel // row_numel, row_numel)

    @staticmethod
    def _swap_in_if_offloaded(param: torch.Tensor) -> bool:
        """Read an NVMe-offloaded partition back; True when this call did (the caller then releases it)."""
        swapper = getattr(param, "nvme_swapper", None)
        if param.ds_tensor.data.dim() == 0 and swapper is not None:
            swapper.swap_in([param], async_op=False)
            return True
        return False
