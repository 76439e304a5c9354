"""DeepSpeedCPULion: Lion on CPU tensors with the cpu_lion op (vectorized C++, OpenMP)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ds_ops._cpu_optimizer import CPUOptimizerBase, KernelBatch, check_non_negative, check_unit_interval
from ds_ops.op_builder import CPULionBuilder

logger = logging.getLogger(__name__)


class DeepSpeedCPULion(CPUOptimizerBase):
    """Lion (Chen et al. 2023) for parameters kept on the CPU, DeepSpeed's class and arguments.

    Per step: `p *= 1 - lr*wd; p -= lr * sign(beta1*m + (1-beta1)*g); m = beta2*m + (1-beta2)*g`.
    Every product is rounded to fp32 on its own (no fused multiply-add), so the result is bitwise
    that of the same formula written with torch tensor ops.

    Args:
        model_params: parameters or param groups (CPU tensors of fp32, bf16 or fp16).
        lr: learning rate (default 1e-3).
        betas: (beta1, beta2): interpolation for the update sign, and the momentum decay (default (0.9, 0.999)).
        weight_decay: decoupled weight decay (default 0).
        fp32_optimizer_states: keep exp_avg in fp32 (default True); else in the parameter's dtype.

    Raises:
        ValueError: a hyper-parameter out of range, or a parameter not on the CPU.
        TypeError: a parameter's dtype is not fp32/bf16/fp16.
        OpNotCompatibleError, OpBuildError: the op cannot be built here (the message says why).
    """

    STATE_KEYS = ("exp_avg",)
    KERNEL = "ds_cpu_lion_step"

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        super().__init__(model_params, defaults, fp32_optimizer_states=fp32_optimizer_states, builder=CPULionBuilder())

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        owner = f"{self._owner} {where}"
        check_non_negative(owner, "lr", group["lr"])
        check_non_negative(owner, "weight_decay", group["weight_decay"])
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{owner}: betas={betas!r} must be a pair (beta1, beta2)")
        check_unit_interval(owner, "betas[0]", betas[0])
        check_unit_interval(owner, "betas[1]", betas[1])

    def _call_kernel(self, batch: KernelBatch, group: dict[str, Any], step: int, num_threads: int) -> int:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        return self._kernel(
            *batch.arrays(), 1 - lr * group["weight_decay"], beta1, 1 - beta1, beta2, 1 - beta2, -lr, num_threads
        )
