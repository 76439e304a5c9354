"""Refuse a script's own `loss.backward()` while gradients need a loss scale, before any gradient exists.

Under fp16 (and fp16 `torch_autocast`) the engine back-propagates `loss * loss_scale` and `step()` divides the
gradients by that scale. A script that calls `loss.backward()` itself skips the multiplication, so `step()`
would silently shrink every update by the scale (256x at `initial_scale_power: 8`) at every ZeRO stage. DeepSpeed
raises "Loss scaling is required" there; ds does the same, from a hook on the forward's outputs, which autograd
runs before it reaches any parameter: nothing has been accumulated or reduced when the error is raised.

A backward is allowed when it comes from `engine.backward(loss)` or from a loss returned by
`engine.scale(loss)`: that tensor carries a hook that marks its own backward as scaled until autograd finishes.
With a loss scale of 1 (bf16, fp32, a static scale of 1) nothing is armed: a direct backward is exact there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["LossScaleGuard"]

_MESSAGE = (
    "Loss scaling is required for this configuration (loss scale {scale:g}), but backward() was called "
    "directly on an unscaled loss, which would silently divide every gradient by the loss scale. Use "
    "engine.backward(loss), or engine.scale(loss).backward() followed by engine.step()."
)


def _grad_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor that requires grad in a forward's output (tensors, sequences, mappings, HF ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _grad_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _grad_tensors(item)


class LossScaleGuard:
    """Arms the forward's outputs; knows which backwards carry the loss scale."""

    def __init__(self, loss_scale: Callable[[], float]) -> None:
        self._loss_scale = loss_scale
        self._scaled_backwards = 0  # engine.backward() calls, or scale()d losses, whose backward is running

    def arm(self, output: Any) -> None:
        """Hook `output`'s tensors so that an unscaled backward through them raises."""
        if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
            return
        if self._loss_scale() == 1.0:
            return
        for tensor in _grad_tensors(output):
            tensor.register_hook(self._check)

    def engine_backward(self) -> _ScaledBackward:
        """Context for `engine.backward`, whose stepper applies the scale itself."""
        return _ScaledBackward(self)

    def mark_scaled(self, scaled_loss: torch.Tensor) -> None:
        """`engine.scale(loss)`'s result: its backward, whenever it runs, is a scaled one."""
        if scaled_loss.requires_grad and self._loss_scale() != 1.0:
            scaled_loss.register_hook(self._begin_scaled_backward)

    def _begin_scaled_backward(self, grad: torch.Tensor) -> None:
        self._scaled_backwards += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._end_scaled_backward)

    def _end_scaled_backward(self) -> None:
        self._scaled_backwards -= 1

    def _check(self, grad: torch.Tensor) -> None:
        if self._scaled_backwards <= 0:
            raise RuntimeError(_MESSAGE.format(scale=self._loss_scale()))


class _ScaledBackward:
    def __init__(self, guard: LossScaleGuard) -> None:
        self._guard = guard

    def __enter__(self) -> None:
        self._guard._scaled_backwards += 1

    def __exit__(self, *exc: object) -> None:
        self._guard._scaled_backwards -= 1
