"""DeepSpeedCPUAdam: Adam and AdamW on CPU tensors with the cpu_adam op (vectorized C++, OpenMP)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ds_ops._cpu_optimizer import CPUOptimizerBase, KernelBatch, check_non_negative, check_unit_interval
from ds_ops.op_builder import CPUAdamBuilder

logger = logging.getLogger(__name__)


class DeepSpeedCPUAdam(CPUOptimizerBase):
    """Adam / AdamW for parameters kept on the CPU (ZeRO-Offload), DeepSpeed's class and arguments.

    Each step runs one pass over every parameter's memory (28 bytes per fp32 parameter: read
    param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq), in tiles spread over
    `torch.get_num_threads()` OpenMP threads. Math is fp32 in torch.optim.Adam's order, so results
    agree with `torch.optim.Adam`/`AdamW` to fp32 rounding; they do not depend on the thread count
    or the CPU's SIMD width. The op is compiled on first use (or prebuilt, see ds_ops.op_builder).

    Args:
        model_params: parameters or param groups (CPU tensors of fp32, bf16 or fp16).
        lr: learning rate (default 1e-3).
        bias_correction: divide the moments by (1 - beta^t) (default True).
        betas: (beta1, beta2) for the first and second moments (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: decoupled (AdamW) when `adamw_mode`, else an L2 term added to the gradient (default 0).
        amsgrad: not supported (DeepSpeed's does not either); True raises.
        adamw_mode: AdamW's decoupled weight decay (default True).
        fp32_optimizer_states: keep exp_avg/exp_avg_sq in fp32 (default True); else in the parameter's dtype.

    Raises:
        ValueError: amsgrad=True, a hyper-parameter out of range, or a parameter not on the CPU.
        TypeError: a parameter's dtype is not fp32/bf16/fp16.
        OpNotCompatibleError, OpBuildError: the op cannot be built here (the message says why).
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq")
    KERNEL = "ds_cpu_adam_step"

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "DeepSpeedCPUAdam: amsgrad=True is not supported; use amsgrad=False (or torch.optim.Adam(amsgrad=True))"
            )
        self.adam_w_mode = adamw_mode
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "amsgrad": amsgrad,
        }
        super().__init__(model_params, defaults, fp32_optimizer_states=fp32_optimizer_states, builder=CPUAdamBuilder())

    def _check_group(self, group: dict[str, Any], where: str) -> None:
        owner = f"{self._owner} {where}"
        check_non_negative(owner, "lr", group["lr"])
        check_non_negative(owner, "eps", group["eps"])
        check_non_negative(owner, "weight_decay", group["weight_decay"])
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{owner}: betas={betas!r} must be a pair (beta1, beta2)")
        check_unit_interval(owner, "betas[0]", betas[0])
        check_unit_interval(owner, "betas[1]", betas[1])
        if group.get("amsgrad"):
            raise ValueError(f"{owner}: amsgrad=True is not supported; use amsgrad=False")

    def _call_kernel(self, batch: KernelBatch, group: dict[str, Any], step: int, num_threads: int) -> int:
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        # Scalars are formed in Python floats (double) and rounded once to fp32, as torch does.
        if group["bias_correction"]:
            bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
        else:
            bias_correction1 = bias_correction2 = 1.0
        decay = 1 - lr * weight_decay if self.adam_w_mode else 1.0
        l2 = 0.0 if self.adam_w_mode else weight_decay
        return self._kernel(
            *batch.arrays(),
            decay,
            l2,
            1 - beta1,
            beta2,
            1 - beta2,
            bias_correction2**0.5,
            group["eps"],
            -(lr / bias_correction1),
            num_threads,
        )
