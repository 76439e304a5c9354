"""`ZenFlowSelectiveAdamW`: Adam on the selected columns of whole parameters (ZenFlow with ZeRO stage 1/2)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch

from ds_ops.adam._zenflow_base import SelectiveAdamWBase

__all__ = ["ZenFlowSelectiveAdamW"]


class ZenFlowSelectiveAdamW(SelectiveAdamWBase):
    """AdamW on `param.data[:, param.selected_indices]` of each parameter (DeepSpeed's class of that name).

    A parameter of 2 or more dimensions is updated on the selected indices of its dim 1 (the columns of
    a weight matrix); a 1-D parameter is updated whole. Everything else (the inputs hung on each
    parameter, per-selection moments, offload in buckets) is in `ds_ops.adam._zenflow_base`. On the
    selected columns, the result is `torch.optim.AdamW` run on those columns alone.

    Args:
        params: parameters or param groups, as for `torch.optim.AdamW` (its other arguments too:
            lr, betas, eps, weight_decay=0.01, amsgrad, maximize).
        offload: keep the moments on the host (`param.exp_avg_cpu_data`), on the device only during
            the step of their bucket.
        bucket_size: with offload, about how many moment elements visit the device at once (default 5e8).
    """

    def temp_copy_param(self, group_to_paramlist: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Snapshot the selected columns of the given parameters into `param.temp_selected_param`."""
        for params in group_to_paramlist.values():
            self._snapshot(params)

    @torch.no_grad()
    def group_step(self, group_to_paramlist: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Update the given parameters of each param group (by index) now; snapshots are not applied."""
        for group_id, params in group_to_paramlist.items():
            self._step_params(group_id, params, apply_temp=False)

    def _compute_device(self, param: torch.Tensor) -> torch.device:
        return param.data.device

    def _storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype

    @contextlib.contextmanager
    def _selected(self, param: torch.Tensor, *, device: torch.device | None, write: bool) -> Iterator[torch.Tensor]:
        data = param.data
        device = data.device if device is None else device
        if data.dim() <= 1:
            value = data if data.device == device else data.to(device)
            yield value
            if write and value is not data:
                data.copy_(value)
            return
        indices = param.selected_indices.to(data.device)
        value = data.index_select(1, indices).to(device)  # a copy: indexing cannot give a view
        yield value
        if write:
            data.index_copy_(1, indices, value.to(data.device))
