"""DeepSpeedCPUAdam: Adam and AdamW on CPU tensors with the cpu_adam op (vectorized C++, OpenMP)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_ops._cpu_optimizer import CPUOptimizerBase, KernelBatch, check_non_negative, check_unit_interval
from ds_ops.adam._scalars import adam_scalars
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
        return self._kernel(*batch.arrays(), *adam_scalars(group, step, self.adam_w_mode), num_threads)

    # ---- DeepSpeed's per-sub-group API (ZeRO-3 offload steps one sub-group's flat partition at a time) --------
    def _subgroup_tensor(self, method: str, subgroup_id: int) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """The one parameter with a gradient (a sub-group's flat partition) and its param group, or None."""
        found = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if len(found) > 1:
            raise ValueError(
                f"{self._owner}.{method}({subgroup_id}): {len(found)} parameters have gradients; a sub-group's "
                "state is one (exp_avg, exp_avg_sq) pair for one tensor, so exactly one parameter may have a "
                "gradient (ZeRO-3 sets param_groups[i]['params'] to the sub-group's flat partition first)"
            )
        return found[0] if found else None

    def _subgroup_batch(self, param: torch.Tensor, state: dict[str, Any], subgroup_id: int) -> KernelBatch:
        for key in self.STATE_KEYS:
            if state[key].numel() != param.numel():
                raise ValueError(
                    f"{self._owner}: sub-group {subgroup_id}'s {key} has {state[key].numel()} elements, the "
                    f"parameter with a gradient has {param.numel()}; a sub-group id names one tensor"
                )
            if not state[key].is_contiguous():
                state[key] = state[key].contiguous()
        batch = KernelBatch()
        batch.add(
            param,
            self._grad(param, f"sub-group {subgroup_id}'s parameter"),
            [state["exp_avg"], state["exp_avg_sq"]],
            None,
        )
        return batch

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step of the parameter that has a gradient, with sub-group `subgroup_id`'s state.

        DeepSpeed's API for ZeRO-3 with optimizer offload: the state lives in `self.state[subgroup_id]`
        (`step`, `exp_avg`, `exp_avg_sq`, created on the first call in fp32, or the parameter's dtype
        when `fp32_optimizer_states=False`), not under the parameter, so one optimizer can step the
        sub-groups' flat partitions one after another. Hyper-parameters come from the parameter's
        param group. With no parameter holding a gradient nothing happens (as in DeepSpeed).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: more than one parameter has a gradient, or the sub-group's state was made for
                a tensor of another size.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = self._subgroup_tensor("step_subgroup", subgroup_id)
        if found is None:
            return loss
        param, group = found
        state = self.state[subgroup_id]
        if not state:
            self._init_state(param, state)
        batch = self._subgroup_batch(param, state, subgroup_id)
        state["step"] += 1
        if param.numel():
            status = self._call_kernel(batch, group, state["step"], torch.get_num_threads())
            assert status == 0, f"ds_cpu_adam_step returned {status}: arguments were checked before the call"
            batch.write_back()
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure: Callable[[], Any] | None = None) -> Any:
        """Undo sub-group `sub_group_id`'s last `step_subgroup`: parameter, exp_avg and exp_avg_sq, and step - 1.

        The step is run backwards from the same gradient (the parameter's `.grad` must still hold the
        gradient of the step being undone) and the group's current hyper-parameters: DeepSpeed's use
        is to retract a step found to have overflowed. Unlike DeepSpeed's, which inverts an AdamW step
        with bias correction on fp32 tensors only, this inverts the step as it was taken: Adam or
        AdamW, with or without bias correction, any parameter and state dtype. The moments come back
        to within fp32 rounding (a few ulps); a bf16/fp16 parameter to within its dtype's rounding,
        since the step rounded it once more. A restored variance is clamped at 0.

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: the sub-group has no state or its step count is 0 (DeepSpeed's messages), or
                no parameter has a gradient.
            ValueError: beta1, beta2 or (AdamW) 1 - lr * weight_decay is 0, so the step lost what it
                replaced; more than one parameter has a gradient; or the state's size does not fit.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if sub_group_id not in self.state or not self.state[sub_group_id]:
            raise RuntimeError(
                f"Cannot rollback optimizer state for sub_group_id {sub_group_id} as it has not been initialized."
            )
        state = self.state[sub_group_id]
        if state.get("step", 0) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}")
        found = self._subgroup_tensor("rollback_subgroup", sub_group_id)
        if found is None:
            raise RuntimeError(
                f"{self._owner}.rollback_subgroup({sub_group_id}) needs the gradient of the step it undoes in "
                "the parameter's .grad; no parameter has a gradient"
            )
        param, group = found
        scalars = adam_scalars(group, state["step"], self.adam_w_mode)
        beta1, beta2 = group["betas"]
        if beta1 == 0 or beta2 == 0 or scalars[0] == 0:
            raise ValueError(
                f"{self._owner}.rollback_subgroup({sub_group_id}): cannot undo a step with betas={group['betas']!r}"
                f" and 1 - lr * weight_decay = {scalars[0]!r}: a factor of 0 discarded the previous state"
            )
        batch = self._subgroup_batch(param, state, sub_group_id)
        if param.numel():
            rollback = self._library.ds_cpu_adam_rollback
            status = rollback(*batch.arrays(), *scalars, beta1, torch.get_num_threads())
            assert status == 0, f"ds_cpu_adam_rollback returned {status}: arguments were checked before the call"
            batch.write_back()
        state["step"] -= 1
        return loss
