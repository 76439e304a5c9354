"""DeepSpeedCPUAdagrad: Adagrad on CPU tensors with the cpu_adagrad op (vectorized C++, OpenMP)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ds_ops._cpu_optimizer import CPUOptimizerBase, KernelBatch, check_non_negative
from ds_ops.op_builder import CPUAdagradBuilder

logger = logging.getLogger(__name__)


class DeepSpeedCPUAdagrad(CPUOptimizerBase):
    """Adagrad for parameters kept on the CPU, DeepSpeed's class and arguments.

    Per step: `sum += g*g; p -= lr * g / (sqrt(sum) + eps)` with `g = grad + weight_decay * p`,
    matching `torch.optim.Adagrad` (lr_decay=0, initial_accumulator_value=0) to fp32 rounding. A
    sparse gradient is densified first, which gives torch's sparse result when weight_decay is 0.

    Args:
        model_params: parameters or param groups (CPU tensors of fp32, bf16 or fp16).
        lr: learning rate (default 1e-2).
        eps: added to the denominator (default 1e-10).
        weight_decay: L2 term added to the gradient (default 0).
        amsgrad: accepted for DeepSpeed's signature; must be False.
        fp32_optimizer_states: keep the squared-gradient sum in fp32 (default True); else in the
            parameter's dtype.

    Raises:
        ValueError: amsgrad=True, a hyper-parameter out of range, or a parameter not on the CPU.
        TypeError: a parameter's dtype is not fp32/bf16/fp16.
        OpNotCompatibleError, OpBuildError: the op cannot be built here (the message says why).
    """

    STATE_KEYS = ("exp_avg_sq",)
    KERNEL = "ds_cpu_adagrad_step"
    SUPPORTS_SPARSE = True

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad: amsgrad=True has no meaning for Adagrad; use amsgrad=False")
        defaults = {"lr": lr, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad}
        super().__init__(
            model_params, defaults, fp32_optimizer_states=fp32_optimizer_states, builder=CPUAdagradBuilder()
        )

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        owner = f"{self._owner} {where}"
        check_non_negative(owner, "lr", group["lr"])
        check_non_negative(owner, "eps", group["eps"])
        check_non_negative(owner, "weight_decay", group["weight_decay"])

    def _call_kernel(self, batch: KernelBatch, group: dict[str, Any], step: int, num_threads: int) -> int:
        return self._kernel(*batch.arrays(), group["weight_decay"], group["eps"], -group["lr"], num_threads)
