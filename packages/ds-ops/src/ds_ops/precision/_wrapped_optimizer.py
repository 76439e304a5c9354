"""`WrappedOptimizer`: the torch.optim.Optimizer face of an optimizer that wraps a base optimizer.

[Note: the face] The stage-0 fp16/bf16 optimizer, ZeRO 1/2 and ZeRO 3 each wrap a user's torch optimizer
(re-pointed at fp32 master copies or partitions) and are handed back to the user in its place. Code written
for a plain optimizer (lr schedulers writing `param_groups[k]["lr"]`, clients reading `state`) and
DeepSpeed's clients (`optimizer.loss_scale`, `optimizer.cur_scale`, `optimizer._global_grad_norm`,
`optimizer.dynamic_loss_scale`, `optimizer.loss_scale_config`) must see
the same thing through any of them: the base optimizer's own groups, state and defaults, live (a write
through the wrapper reaches the base optimizer), and the loss scaler's current scale. This mixin is that
face, written once.

It holds no state of its own: a class using it sets `optimizer` (the base optimizer) and `loss_scaler`,
and records each step's result with `_record_outcome`. A class that also derives from
`torch.optim.Optimizer` (for `isinstance` checks) lists this mixin first, so these properties shadow the
attributes `Optimizer.__init__` would have set (it is never called); torch's `__getstate__`, `__repr__`
and `state_dict` read `param_groups`/`state`/`defaults` through them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ds_ops.precision._loss_scale_view import LossScaleView
from ds_ops.precision._loss_scaler import LossScaler
from ds_ops.precision._step import StepOutcome

logger = logging.getLogger(__name__)

__all__ = ["WrappedOptimizer"]


class WrappedOptimizer:
    """Mixin: `param_groups`, `state`, `defaults`, `loss_scale`, `cur_scale`, `global_grad_norm` of a wrapper.

    Attributes the class sets:
        optimizer: the wrapped base optimizer; `param_groups`, `state` and `defaults` are its own objects
            (read and assigned through).
        loss_scaler: the `ds_ops.precision` scaler the wrapper scales the loss with.
        overflow: whether the last step was skipped (set by `_record_outcome`).
        _global_grad_norm: the unscaled global gradient norm of the last step, before clipping, as a 0-d fp32
            tensor (DeepSpeed's attribute name and type: scripts call `torch.isfinite` on it); None before the
            first step or when the step did not compute it. `global_grad_norm` gives it as a float.
    """

    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler
    overflow: bool = False
    _grad_norm: float | None = None

    if TYPE_CHECKING:

        def zero_grad(self, set_to_none: bool = True) -> None: ...

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's param groups (lr schedulers write `lr` here); `params` are what it steps."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The base optimizer's per-parameter state, keyed by the tensors it steps."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The base optimizer's default hyper-parameters."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def loss_scale(self) -> float:
        """The loss scale the next backward multiplies by (1.0 without dynamic or static fp16 scaling)."""
        return float(self.loss_scaler.loss_scale)

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's other name of `loss_scale`."""
        return float(self.loss_scaler.cur_scale)

    @property
    def dynamic_loss_scale(self) -> bool:
        """DeepSpeed's flag: whether the loss scale adapts to overflows (fp16 with `loss_scale: 0`)."""
        return bool(self.loss_scaler.dynamic)

    @property
    def loss_scale_config(self) -> LossScaleView:
        """DeepSpeed's record of the scaling settings and counters, read live from the scaler."""
        return LossScaleView(self.loss_scaler)

    def needs_scaler(self) -> bool:
        """DeepSpeed's check: must a backward the script runs itself go through `engine.scale(loss)`?

        True with dynamic fp16 scaling and with a static scale other than 1 (DeepSpeed 0.19.8 answers False
        for a static scale, although its step then divides unscaled gradients by it); False for bf16/fp32.
        """
        return self.loss_scale_config.use_grad_scaling

    @property
    def global_grad_norm(self) -> float | None:
        """The unscaled global gradient norm of the last step, before clipping (None before any step, or
        when the step did not compute it)."""
        return self._grad_norm

    @property
    def _global_grad_norm(self) -> torch.Tensor | None:
        return None if self._grad_norm is None else torch.tensor(self._grad_norm, dtype=torch.float32)

    @_global_grad_norm.setter
    def _global_grad_norm(self, value: float | torch.Tensor | None) -> None:
        self._grad_norm = None if value is None else float(value)

    def _record_outcome(self, outcome: StepOutcome) -> bool:
        """Keep the overflow flag and the norm of `finish_step`'s decision; on a skipped step clear the
        gradients (the next window starts from zero, as after an applied step).

        Returns:
            True when the caller must apply the update, False when the step is skipped.
        """
        self.overflow = outcome.overflow
        self._grad_norm = outcome.grad_norm
        if self.overflow:
            self.zero_grad()
            return False
        return True
