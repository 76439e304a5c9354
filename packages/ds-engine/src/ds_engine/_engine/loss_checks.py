"""What `engine.backward(loss)` and `engine.scale(loss)` accept as a loss: one element that requires grad.

A non-scalar (a model's raw output passed by mistake) would otherwise back-propagate with an implicit
gradient of ones or fail deep inside autograd; the check names the call, the shape and `requires_grad`.
The error is a `ds_comm.UsageError`: a `ValueError` and, because DeepSpeed asserts this and scripts catch its
`AssertionError`, an `AssertionError` too.
"""

from __future__ import annotations

from typing import Any

import torch

import ds_comm

__all__ = ["LossNotScalarError", "check_scalar_loss"]


class LossNotScalarError(ds_comm.UsageError):
    """The loss handed to `backward`/`scale` is not a one-element tensor that requires grad."""


def check_scalar_loss(loss: Any, call: str) -> None:
    """Raise `LossNotScalarError` naming `call` unless `loss` is a one-element tensor that requires grad."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return
    got = type(loss).__name__
    if isinstance(loss, torch.Tensor):
        got += f" of shape {tuple(loss.shape)}, requires_grad={loss.requires_grad}"
    raise LossNotScalarError(
        f"{call}: loss must be a scalar tensor (one element) that requires grad, got {got}; for a non-scalar "
        "output back-propagate it yourself with tensor.backward(grad)"
    )
