"""The scalars every Adam kernel takes (CPU step, CPU rollback, CUDA multi-tensor step), formed in one place."""

from __future__ import annotations

from typing import Any


def adam_scalars(group: dict[str, Any], step: int, adam_w_mode: bool) -> tuple[float, ...]:
    """(decay, l2, 1 - beta1, beta2, 1 - beta2, sqrt(bias_correction2), eps, -lr / bias_correction1) for `step`.

    Formed in Python floats (double) and rounded once to fp32 by the call, as torch does. AdamW decays
    the parameter (decay = 1 - lr * weight_decay, l2 = 0); Adam adds weight_decay * p to the gradient
    (decay = 1, l2 = weight_decay). `bias_correction=False` uses 1 for both corrections.
    """
    beta1, beta2 = group["betas"]
    lr, weight_decay = group["lr"], group["weight_decay"]
    if group["bias_correction"]:
        bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
    else:
        bias_correction1 = bias_correction2 = 1.0
    return (
        1 - lr * weight_decay if adam_w_mode else 1.0,
        0.0 if adam_w_mode else weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        bias_correction2**0.5,
        group["eps"],
        -(lr / bias_correction1),
    )
