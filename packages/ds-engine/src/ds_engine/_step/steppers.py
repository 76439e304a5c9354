"""How a step happens, chosen once at initialize(): fp32 at stage 0, or ds-zero's optimizer at stage >= 1.

The fp16/bf16 stage-0 stepper is `MixedPrecisionOptimizer` in `_step/precision.py`. All three offer the
same small interface the engine drives (`Stepper`), so `engine.step()` has no precision or ZeRO
branches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from ds_engine._report.timers import NullTimers, WallClockTimers
from ds_engine._step.data_parallel import FlatGradBuffer, GradAllReducer
from ds_engine._step.zero_contract import ZeroOptimizer
from ds_ops.precision import LossScaler, finish_step

logger = logging.getLogger(__name__)

__all__ = ["Fp32Stepper", "PlainOptimizerState", "Stepper", "ZeroStepper"]


class Stepper(Protocol):
    """What the engine needs from its optimizer side."""

    def backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        """Backward of an already gas-scaled loss (the stepper applies any loss scale)."""

    def step(self, skip: torch.Tensor | None = None) -> bool:
        """Reduce, unscale/check/clip as configured, update; False when the step was skipped.

        `skip` is a 1-element flag the caller already agreed across every rank that must skip together
        (the pipeline engine's stages); non-zero skips the step as an overflow does (scaler included).
        """

    def zero_grad(self) -> None: ...

    @property
    def global_grad_norm(self) -> float | None: ...

    @property
    def loss_scale(self) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], *, load_from_fp32_weights: bool = True) -> None: ...

    def refresh_from_module(self) -> None:
        """Re-derive any master copy from the (just loaded) module weights."""


class PlainOptimizerState:
    """What an fp32 stepper at stage 0 reports and saves: the base optimizer's own state, no loss scale.

    The optimizer steps the model's parameters themselves (no masters), so there is nothing to refresh
    after a module-only load. Subclasses set `optimizer` and `_norm` (the last clipping norm).
    """

    optimizer: Optimizer
    _norm: float | None

    @property
    def global_grad_norm(self) -> float | None:
        return self._norm

    @property
    def loss_scale(self) -> float:
        return 1.0

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def state_params(self) -> list[torch.Tensor]:
        """The model parameters `state_dict()`'s indices stand for, in index order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def load_state_dict(self, state: dict[str, Any], *, load_from_fp32_weights: bool = True) -> None:
        self.optimizer.load_state_dict(state)

    def refresh_from_module(self) -> None:
        return None


class Fp32Stepper(PlainOptimizerState):
    """fp32 training at ZeRO stage 0: flat gradients, bucketed all-reduce, global-norm clipping, `optimizer.step()`.

    Args:
        optimizer: the base optimizer (returned by initialize() as is, as DeepSpeed does for fp32).
        buffer: the flat gradient buffer bound to the optimizer's parameters.
        reducer: the data-parallel all-reducer, None on one rank.
        clip: `gradient_clipping` (0: off; the norm is then not computed, as in DeepSpeed).
        timers: times the all-reduce.
        model_parallel_group: the tensor-parallel group (None: none); the norm spans it.
        model_parallel_params: the parameters cut across it (`_tensor_parallel`'s note: the norm and the
            overflow flag); the others are counted once.
        scaler: a loss scaler (fp16 `torch_autocast` over fp32 parameters: activations' gradients are fp16
            and underflow unscaled); steps with inf/nan gradients are then skipped. None: no scaling.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        buffer: FlatGradBuffer,
        reducer: GradAllReducer | None,
        clip: float,
        timers: WallClockTimers | NullTimers,
        model_parallel_group: ProcessGroup | None = None,
        model_parallel_params: Sequence[torch.Tensor] = (),
        scaler: LossScaler | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.buffer = buffer
        self.reducer = reducer
        self.clip = clip
        self.timers = timers
        self._norm: float | None = None
        self._reduced = False
        self.model_parallel_group = model_parallel_group
        self._cut_grads = buffer.views_of(model_parallel_params) if model_parallel_group is not None else None

    def backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        (loss if self.scaler is None else self.scaler.scale_loss(loss)).backward(retain_graph=retain_graph)

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else float(self.scaler.loss_scale)

    def reduce_gradients(self) -> None:
        """All-reduce the accumulated gradients now (`engine.allreduce_gradients()`); the step then skips it."""
        if self._reduced:
            return
        self.buffer.rebind()
        if self.reducer is not None:
            self.timers.start("allreduce")
            self.reducer.all_reduce()
            self.timers.stop("allreduce")
        self._reduced = True

    def step(self, skip: torch.Tensor | None = None) -> bool:
        self.reduce_gradients()
        self._reduced = False
        outcome = finish_step(
            [self.buffer.flat],
            scaler=self.scaler,
            clip=self.clip,
            check_overflow=self.scaler is not None,
            skip=skip,
            model_parallel_group=self.model_parallel_group,
            model_parallel_grads=self._cut_grads,
        )
        if outcome.grad_norm is not None:
            self._norm = outcome.grad_norm
        if outcome.applied:
            self.optimizer.step()
        self.buffer.release()
        return outcome.applied

    def zero_grad(self) -> None:
        self.buffer.release()
        self._reduced = False


class ZeroStepper:
    """Adapter over ds-zero's `DeepSpeedZeroOptimizer` / `DeepSpeedZeroOptimizer_Stage3` (`_zero_contract`).

    ds-zero owns reduction, loss scaling, clipping and the partitioned update; the engine only
    divides the loss by the accumulation steps before `backward`.
    """

    def __init__(self, zero_optimizer: ZeroOptimizer) -> None:
        self.optimizer = zero_optimizer

    def backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        self.optimizer.backward(loss, retain_graph=retain_graph)

    def set_step_boundary(self, is_boundary: bool) -> None:
        """Tell the ZeRO optimizer whether the coming backward ends the accumulation window (stage 3 with
        the optimizer on NVMe then updates sub-groups during that backward where it can)."""
        hint = getattr(self.optimizer, "set_step_boundary", None)
        if hint is not None:
            hint(is_boundary)

    def step(self, skip: torch.Tensor | None = None) -> bool:
        applied = bool(self.optimizer.step(skip=skip))
        # DeepSpeed's engine clears gradients after every boundary step; ZeRO-3's optimizer relies on
        # it (its fp32 gradient partitions accumulate across micro-steps until zero_grad()).
        self.optimizer.zero_grad(set_to_none=True)
        return applied

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def global_grad_norm(self) -> float | None:
        norm = self.optimizer.global_grad_norm
        return None if norm is None else float(norm)

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.loss_scale)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, load_from_fp32_weights: bool = True) -> None:
        raise TypeError("ZeRO optimizer states load from all ranks' files; use load_partitions()")

    def load_partitions(
        self, states: list[dict[str, Any]], *, load_optimizer_states: bool, load_from_fp32_weights: bool
    ) -> None:
        """Every saved rank's `optimizer_state_dict`, in rank order (ds-zero re-partitions)."""
        self.optimizer.load_state_dict(
            states, load_optimizer_states=load_optimizer_states, load_from_fp32_weights=load_from_fp32_weights
        )

    def refresh_from_module(self) -> None:
        self.optimizer.refresh_fp32_params()
