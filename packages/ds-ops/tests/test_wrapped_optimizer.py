"""`WrappedOptimizer`: the optimizer face reads and writes through to the base optimizer and the loss scaler."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ds_ops.precision import DynamicLossScaler, LossScaler, StepOutcome, WrappedOptimizer


class Plain(WrappedOptimizer):
    """A wrapper that is not a torch optimizer (ds-engine's stage-0 fp16/bf16 optimizer is one)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
        self.optimizer = optimizer
        self.loss_scaler = scaler
        self.zero_grad_calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_calls += 1


class Subclass(WrappedOptimizer, torch.optim.Optimizer):
    """A wrapper that is a torch optimizer without calling its __init__ (ds-zero's stage-1/2 optimizer is one)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
        self.optimizer = optimizer
        self.loss_scaler = scaler

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.optimizer.step()


def _sgd(lr: float = 0.1) -> tuple[torch.nn.Parameter, torch.optim.SGD]:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    return p, torch.optim.SGD([p], lr=lr, momentum=0.9)


@pytest.mark.parametrize("cls", [Plain, Subclass])
def test_lr_written_through_param_groups_reaches_the_base_optimizer(cls: type) -> None:
    p, base = _sgd()
    wrapped = cls(base, LossScaler())
    assert wrapped.param_groups is base.param_groups
    wrapped.param_groups[0]["lr"] = 0.5
    p.grad = torch.tensor([1.0, 2.0, -4.0])
    before = p.detach().clone()
    base.step()
    torch.testing.assert_close(p.detach(), before - 0.5 * p.grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("cls", [Plain, Subclass])
def test_param_groups_state_and_defaults_assign_through(cls: type) -> None:
    p, base = _sgd()
    wrapped = cls(base, LossScaler())
    groups = [dict(base.param_groups[0], lr=0.25)]
    wrapped.param_groups = groups
    assert base.param_groups is groups and wrapped.param_groups[0]["lr"] == 0.25

    p.grad = torch.ones(3)
    base.step()
    assert wrapped.state is base.state
    torch.testing.assert_close(wrapped.state[p]["momentum_buffer"], torch.ones(3))
    replaced: Any = {p: {"momentum_buffer": torch.full((3,), 7.0)}}
    wrapped.state = replaced
    assert base.state is replaced

    assert wrapped.defaults is base.defaults and wrapped.defaults["momentum"] == 0.9
    defaults = dict(base.defaults, lr=3.0)
    wrapped.defaults = defaults
    assert base.defaults is defaults


def test_loss_scale_and_cur_scale_follow_the_scaler() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=2, delayed_shift=1)
    wrapped = Plain(_sgd()[1], scaler)
    assert wrapped.loss_scale == wrapped.cur_scale == 256.0
    assert type(wrapped.loss_scale) is float and type(wrapped.cur_scale) is float
    scaler.update_scale(overflow=True)
    assert wrapped.loss_scale == wrapped.cur_scale == 128.0
    scaler.load_state_dict({"cur_scale": 32})
    assert wrapped.loss_scale == 32.0 and type(wrapped.loss_scale) is float
    assert Plain(_sgd()[1], LossScaler(4.0)).loss_scale == 4.0


def test_record_outcome_keeps_the_norm_and_clears_gradients_on_a_skip() -> None:
    wrapped = Plain(_sgd()[1], LossScaler())
    assert wrapped.global_grad_norm is None and wrapped.overflow is False
    assert wrapped._record_outcome(StepOutcome(applied=True, grad_norm=1.5)) is True
    assert wrapped.global_grad_norm == 1.5 and wrapped._global_grad_norm == 1.5
    assert wrapped.overflow is False and wrapped.zero_grad_calls == 0
    assert wrapped._record_outcome(StepOutcome(applied=False, grad_norm=math.inf)) is False
    assert wrapped.overflow is True and wrapped.global_grad_norm == math.inf and wrapped.zero_grad_calls == 1


def test_torch_optimizer_methods_read_the_base_optimizer_through_the_face() -> None:
    """`__getstate__` (pickling, copy) and `__repr__` come from torch.optim.Optimizer and read the face."""
    p, base = _sgd()
    wrapped = Subclass(base, LossScaler())
    assert isinstance(wrapped, torch.optim.Optimizer)
    p.grad = torch.ones(3)
    base.step()
    state = wrapped.__getstate__()
    assert state["param_groups"] is base.param_groups and state["state"] is base.state
    assert state["defaults"] is base.defaults
    assert "lr: 0.1" in repr(wrapped) and "momentum: 0.9" in repr(wrapped)
    assert "param_groups" not in vars(wrapped) and "state" not in vars(wrapped)


def test_an_lr_scheduler_over_the_wrapper_drives_the_base_lr() -> None:
    _, base = _sgd(lr=1.0)
    wrapped = Subclass(base, LossScaler())
    sched = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=0.5)
    assert base.param_groups[0]["initial_lr"] == 1.0
    wrapped.step()
    sched.step()
    sched.step()
    assert base.param_groups[0]["lr"] == pytest.approx(0.25)


@pytest.mark.parametrize("cls", [Plain, Subclass])
def test_deepspeeds_loss_scale_config_reads_the_scaler_live(cls: type) -> None:
    _, base = _sgd()
    scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=2, min_scale=0.5, delayed_shift=1)
    wrapped = cls(base, scaler)
    view = wrapped.loss_scale_config
    assert wrapped.dynamic_loss_scale is True and view.dynamic_loss_scale is True and view.use_grad_scaling
    assert wrapped.needs_scaler()
    assert (view.cur_scale, view.cur_iter, view.scale_window) == (256.0, 0, 2)
    assert (view.scale_factor, view.min_loss_scale, view.last_overflow_iter) == (2.0, 0.5, -1)
    for _ in range(3):  # DeepSpeed's count: the scale doubles at the update after a window of 2 clean steps
        scaler.update_scale(False)
    assert (view.cur_scale, view.cur_iter) == (512.0, 3)
    scaler.update_scale(True)  # an overflow halves it at once (delayed_shift 1)
    assert (view.cur_scale, view.cur_iter, view.last_overflow_iter) == (256.0, 4, 3)

    static = cls(base, LossScaler()).loss_scale_config
    assert static.dynamic_loss_scale is False and not static.use_grad_scaling
    assert static.cur_scale == 1.0
    assert (static.scale_window, static.scale_factor, static.min_loss_scale) == (None, None, None)
    assert cls(base, LossScaler(128.0)).loss_scale_config.use_grad_scaling
    assert cls(base, LossScaler(128.0)).needs_scaler() and not cls(base, LossScaler()).needs_scaler()


def test_global_grad_norm_is_deepspeeds_tensor_and_a_float_through_the_property() -> None:
    """`optimizer._global_grad_norm` is a 0-d fp32 tensor, as in DeepSpeed (scripts call `torch.isfinite` on it);
    `global_grad_norm` (what the engine reports) is the same value as a float; None before any step."""

    class Wrapper(WrappedOptimizer):
        pass

    w = Wrapper()
    assert w._global_grad_norm is None and w.global_grad_norm is None
    w._global_grad_norm = 2.5
    assert isinstance(w._global_grad_norm, torch.Tensor) and w._global_grad_norm.dim() == 0
    assert bool(torch.isfinite(w._global_grad_norm)) and float(w._global_grad_norm) == 2.5
    assert w.global_grad_norm == 2.5 and isinstance(w.global_grad_norm, float)
    w._global_grad_norm = torch.tensor(float("inf"))
    assert not bool(torch.isfinite(w._global_grad_norm)) and w.global_grad_norm == float("inf")
