"""What ZenFlow's two selective AdamW optimizers share: the per-selection state, the step rules, offload.

ZenFlow (DeepSpeed's importance-aware ZeRO-Offload) splits each step: the few gradient columns that
matter most ("selected", e.g. the top 10% by norm) are updated at once on the accelerator, the rest are
accumulated and applied later by the CPU optimizer. The selective optimizer does the first half: Adam on
the selected columns only, with moments that belong to the selection. The caller (ZenFlow's training
loop) hangs the inputs on each parameter, as DeepSpeed does:

- `selected_indices`: the selected columns (a 1-D index tensor; ignored for 1-D parameters, which
  are updated whole);
- `selected_grad`: the gradient of exactly those columns (the slice's shape); None or absent = no
  update this step. Consumed (set to None) by the step;
- `temp_selected_param` (optional): a snapshot of the selected columns taken by `temp_copy_param()`;
  the step first puts it back into the parameter (the CPU optimizer may have rewritten those columns
  in between), then updates, then drops it.

Moments are per selection: `exp_avg`/`exp_avg_sq` have the slice's shape. Without offload they live in
`self.state[param]`; with `offload=True` they live on the host as `param.exp_avg_cpu_data` /
`param.exp_avg_sq_cpu_data` (made here, zero, when missing) and visit the device one bucket of
parameters at a time (`bucket_size` elements of moments), so device memory holds at most one bucket's
moments. `state["step"]` (a 0-dim fp32 tensor on the host, as torch's AdamW keeps it) counts the updates
a parameter has had; clearing the moments for a new selection (`clear_selected_mv`) keeps it.

The subclasses say where the selected slice lives: the columns of `param.data` (ZeRO stage 1/2,
`ZenFlowSelectiveAdamW`) or rows of a transposed ZeRO-3 partition (`ZenFlowSelectiveAdamW_stage3`).
"""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ds_ops.adam._adamw_update import AdamWHyper, adamw_update_

logger = logging.getLogger(__name__)

__all__ = ["SelectiveAdamWBase"]

_HOST_MOMENTS = ("exp_avg_cpu_data", "exp_avg_sq_cpu_data")


def _has_selected_grad(param: torch.Tensor) -> bool:
    return getattr(param, "selected_grad", None) is not None


class SelectiveAdamWBase(torch.optim.AdamW, abc.ABC):
    """torch's AdamW arguments, plus `offload` (moments on the host) and `bucket_size` (see module note).

    `step` is bound once at construction to `_step_with_offload` or `_step_without_offload`, as in
    DeepSpeed, so the step path does not branch on the setting.

    Raises:
        ValueError: `bucket_size` is not positive, or (at a step) a parameter's `selected_grad` or moments
            do not have the selected slice's shape.
    """

    def __init__(
        self, params: Iterable[Any], *args: Any, offload: bool = False, bucket_size: float = 5e8, **kwargs: Any
    ):
        super().__init__(params, *args, **kwargs)
        if not bucket_size > 0:
            raise ValueError(f"bucket_size must be positive, got {bucket_size!r}")
        self.offload = bool(offload)
        self.bucket_size = int(bucket_size)
        self.step = self._step_with_offload if self.offload else self._step_without_offload  # type: ignore[method-assign]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        # A step count saved in half precision would stop counting at 2048 (fp16); keep it fp32.
        for param_state in self.state.values():
            step = param_state.get("step")
            if torch.is_tensor(step) and step.dtype in (torch.float16, torch.bfloat16):
                param_state["step"] = step.float()

    # -- where the slice lives (the subclass) ------------------------------------------------------------
    @abc.abstractmethod
    def _compute_device(self, param: torch.Tensor) -> torch.device:
        """Where the update runs (the gradient's and the moments' device)."""

    @abc.abstractmethod
    def _storage_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype of the values the slice is read from (the moments get it too)."""

    @abc.abstractmethod
    def _selected(
        self, param: torch.Tensor, *, device: torch.device | None, write: bool
    ) -> contextlib.AbstractContextManager[torch.Tensor]:
        """The selected slice on `device` (None: where it is stored); with `write`, stored back on exit."""

    # -- the steps -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _step_without_offload(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter with a `selected_grad`, one param group at a time."""
        loss = _call(closure)
        for group_id, group in enumerate(self.param_groups):
            self._step_params(group_id, group["params"], apply_temp=True)
        return loss

    @torch.no_grad()
    def _step_with_offload(self, closure: Callable[[], Any] | None = None) -> Any:
        """As `_step_without_offload`, in buckets of about `bucket_size` moment elements per device visit."""
        loss = _call(closure)
        for group_id, group in enumerate(self.param_groups):
            bucket: list[torch.Tensor] = []
            numel = 0
            for param in group["params"]:
                if not _has_selected_grad(param):
                    continue
                bucket.append(param)
                numel += param.selected_grad.numel()
                if numel >= self.bucket_size:
                    self._step_params(group_id, bucket, apply_temp=True)
                    bucket, numel = [], 0
            if bucket:
                self._step_params(group_id, bucket, apply_temp=True)
        return loss

    def _step_params(self, group_id: int, params: Sequence[torch.Tensor], *, apply_temp: bool) -> None:
        """One AdamW update of each of `params` (of param group `group_id`) that has a `selected_grad`."""
        live = [p for p in params if _has_selected_grad(p)]
        if not live:
            return
        hyper = AdamWHyper.from_group(self.param_groups[group_id])
        if self.offload:
            self.copy_mv_from_cpu(live)
        try:
            for param in live:
                self._update_one(param, hyper, apply_temp=apply_temp)
                # Consumed at once: if a later parameter fails, a retry does not update this one twice.
                param.selected_grad = None
                if apply_temp and hasattr(param, "temp_selected_param"):
                    param.temp_selected_param = None
        finally:
            if self.offload:  # also on failure: the moments of the parameters already updated are kept
                self.copy_mv_to_cpu(live)

    def _update_one(self, param: torch.Tensor, hyper: AdamWHyper, *, apply_temp: bool) -> None:
        grad = param.selected_grad
        device = self._compute_device(param)
        with self._selected(param, device=device, write=True) as value:
            if tuple(grad.shape) != tuple(value.shape):
                raise ValueError(
                    f"selected_grad has shape {tuple(grad.shape)} but the parameter's selected slice "
                    f"(what selected_indices picks) has shape {tuple(value.shape)}"
                )
            temp = getattr(param, "temp_selected_param", None) if apply_temp else None
            if temp is not None:
                value.copy_(temp.to(device, non_blocking=True).view_as(value))
            state = self._state_of(param, value, hyper)
            if self.offload:
                if param.exp_avg.numel() != value.numel():
                    raise ValueError(
                        f"the host moments (exp_avg_cpu_data) hold {param.exp_avg.numel()} elements but the "
                        f"selection has {value.numel()} {tuple(value.shape)}"
                    )
                exp_avg, exp_avg_sq = param.exp_avg.view_as(value), param.exp_avg_sq.view_as(value)
            else:
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            adamw_update_(
                value, grad.to(device), exp_avg, exp_avg_sq, state["step"], hyper, state.get("max_exp_avg_sq")
            )

    def _state_of(self, param: torch.Tensor, value: torch.Tensor, hyper: AdamWHyper) -> dict[str, Any]:
        """The parameter's state, made on first use; its moments must have the selection's shape."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        wanted = ("max_exp_avg_sq",) if hyper.amsgrad else ()
        if not self.offload:
            wanted = ("exp_avg", "exp_avg_sq", *wanted)
        for name in wanted:
            if name not in state:
                state[name] = torch.zeros_like(value)
            elif state[name].shape != value.shape:
                raise ValueError(
                    f"the optimizer state {name!r} has shape {tuple(state[name].shape)} but the selection now "
                    f"has shape {tuple(value.shape)}: moments belong to one selection size (ZenFlow keeps "
                    "the number of selected columns fixed)"
                )
        return state

    # -- offloaded moments -----------------------------------------------------------------------------------
    def copy_mv_from_cpu(self, params: Iterable[torch.Tensor]) -> None:
        """Bring each parameter's host moments to its compute device as `param.exp_avg` / `param.exp_avg_sq`.

        Host moments missing on a parameter with a `selected_grad` are made (zero, the slice's shape).
        """
        for param in params:
            if getattr(param, "exp_avg_cpu_data", None) is None and _has_selected_grad(param):
                pin = torch.cuda.is_available()
                for name in _HOST_MOMENTS:
                    zeros = torch.zeros(
                        param.selected_grad.shape, dtype=self._storage_dtype(param), device="cpu", pin_memory=pin
                    )
                    setattr(param, name, zeros)
            device = self._compute_device(param)
            param.exp_avg = param.exp_avg_cpu_data.to(device, non_blocking=True)
            param.exp_avg_sq = param.exp_avg_sq_cpu_data.to(device, non_blocking=True)

    def copy_mv_to_cpu(self, params: Iterable[torch.Tensor]) -> None:
        """Store `param.exp_avg` / `param.exp_avg_sq` back into the host moments and drop the device copies."""
        for param in params:
            # Blocking: the host copy must be complete before anyone reads it (or the next bucket reuses memory).
            param.exp_avg_cpu_data.copy_(param.exp_avg)
            param.exp_avg_sq_cpu_data.copy_(param.exp_avg_sq)
            param.exp_avg = None
            param.exp_avg_sq = None

    # -- selection bookkeeping ---------------------------------------------------------------------------------
    def clear_selected_mv(self) -> None:
        """Zero the first and second moments of every parameter that has state (a new selection starts).

        The step counts stay (bias correction keeps counting), as do AMSGrad maxima, as in DeepSpeed.
        """
        logger.info("ZenFlow: clearing the selective optimizer's moments")
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                if self.offload:
                    for name in _HOST_MOMENTS:
                        moments = getattr(param, name, None)
                        if moments is not None:
                            moments.zero_()
                else:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()

    def _snapshot(self, params: Iterable[torch.Tensor]) -> None:
        """`param.temp_selected_param` = a copy of the selected slice (on the host when offloading)."""
        for param in params:
            if not hasattr(param, "selected_grad"):
                continue
            with self._selected(param, device=None, write=False) as value:
                param.temp_selected_param = value.to("cpu", copy=True) if self.offload else value.clone()


def _call(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
