"""`deepspeed.runtime.utils.CheckOverflow` and `get_weight_norm`: an inf/nan gradient check agreed across ranks.

DeepSpeed's optimizers (and client code written against them) ask "did any rank overflow?" either from the
gradients (`check()`: an inf or NaN in any `.grad`) or from norms computed already (`check_using_norm()`:
`get_weight_norm` and friends return -1 for a non-finite norm). Every rank must skip the step together, so
the local answer is combined with MAX over the ranks that share the step:

- the largest expert-parallel group, when some parameter is an MoE expert's (`param.allreduce is False`):
  an expert's gradient exists on its expert-parallel rank only;
- the whole world with `zero_reduce_scatter` (ZeRO partitions the gradients over every rank);
- the model-parallel group with an `mpu` (plus the data-parallel group when the engine does not
  all-reduce gradients in backward);
- otherwise the world when the engine does not all-reduce gradients (`enable_backward_allreduce` false),
  or, for `check_using_norm`, when `reduce_overflow` is set.

The engine's own steps do not use this class: `ds_ops.precision.finish_step` fuses the check into the
step's one reduction. It is here for DeepSpeed's API.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

import ds_comm
from ds_engine._step.grad_norms import has_inf_or_nan, model_parallel_norm

__all__ = ["CheckOverflow", "get_weight_norm", "is_moe_param"]


def is_moe_param(param: torch.Tensor) -> bool:
    """An MoE expert's parameter: DeepSpeed marks those `allreduce = False` (reduced per expert group only)."""
    return hasattr(param, "allreduce") and not param.allreduce


def _flag_device() -> torch.device:
    if ds_comm.is_initialized():
        return torch.device(ds_comm.get_accelerator().current_device_name())
    return torch.device("cpu")


def get_weight_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2, mpu: Any = None) -> float:
    """The `norm_type` norm of the tensors themselves (not their `.grad`), over the model-parallel group.

    With an `mpu`, a tensor that is not model-parallel (replicated on every model-parallel rank) counts on
    model-parallel rank 0 only. Returns -1 for an inf or NaN norm: DeepSpeed's overflow marker, which
    `CheckOverflow.check_using_norm` looks for.
    """
    tensors = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = model_parallel_norm(tensors, norm_type, mpu)
    value = float(total)
    return -1.0 if not math.isfinite(value) else value


class CheckOverflow:
    """Whether any rank's gradients hold an inf or NaN (see the module docstring for which ranks agree).

    Args:
        param_groups: lists of parameters `check()` looks at (and whose MoE parameters widen the agreement).
        mpu: a Megatron-style model-parallel unit (`get_model_parallel_group()`, ...).
        zero_reduce_scatter: gradients are partitioned over every rank: agree over the world.
        deepspeed: the engine; when it does not all-reduce gradients in backward the data-parallel ranks
            agree too.
    """

    def __init__(
        self,
        param_groups: Sequence[Sequence[torch.Tensor]] | None = None,
        mpu: Any = None,
        zero_reduce_scatter: bool = False,
        deepspeed: Any = None,
    ) -> None:
        self.mpu = mpu
        self.params: list[torch.Tensor] | None = [p for g in param_groups for p in g] if param_groups else None
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.has_moe_params = any(is_moe_param(p) for p in self.params or [])

    # -- local checks ---------------------------------------------------------------------------------------
    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor, i: int = 0) -> bool:
        """Whether `x` holds an inf or NaN (DeepSpeed's static method; `i` is unused there too)."""
        del i
        return bool(has_inf_or_nan(x))

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether this rank's gradient of any of `params` holds an inf or NaN (no communication)."""
        return any(p.grad is not None and bool(has_inf_or_nan(p.grad.detach())) for p in params)

    # -- agreed checks --------------------------------------------------------------------------------------
    def check_using_norm(self, norm_group: Iterable[float | torch.Tensor], reduce_overflow: bool = True) -> bool:
        """Whether any rank's norms include DeepSpeed's overflow marker -1 (or an inf/NaN)."""
        local = any(self._bad_norm(n) for n in norm_group)
        groups = self._moe_groups()
        if self.mpu is not None:
            groups.append(self.mpu.get_model_parallel_group())
        elif reduce_overflow:
            groups.append(None)
        return self._agree(local, groups)

    def check(self, param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> bool:
        """Whether any rank's gradient of the given (default: the constructor's) parameters holds an inf/NaN.

        Raises:
            ds_comm.UsageError: no parameters here and none given to the constructor.
        """
        if param_groups is not None:
            params = [p for g in param_groups for p in g]
        elif self.params is not None:
            params = self.params
        else:
            raise ds_comm.UsageError("CheckOverflow.check(): pass param_groups here or to CheckOverflow(param_groups)")
        return self.has_overflow(params)

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: bool | None = None) -> bool:
        """`has_overflow_serial(params)` agreed over the ranks that share the step."""
        local = self.has_overflow_serial(params)
        moe = self.has_moe_params if has_moe_params is None else has_moe_params
        groups = self._moe_groups() if moe else []
        no_backward_allreduce = self.deepspeed is not None and not self._engine_reduces_in_backward()
        if self.zero_reduce_scatter:
            groups.append(None)
        elif self.mpu is not None:
            if no_backward_allreduce:
                groups.append(self.mpu.get_data_parallel_group())
            groups.append(self.mpu.get_model_parallel_group())
        elif no_backward_allreduce:
            groups.append(None)
        return self._agree(local, groups)

    # -- helpers --------------------------------------------------------------------------------------------
    @staticmethod
    def _bad_norm(norm: float | torch.Tensor) -> bool:
        value = float(norm)
        return value == -1 or not math.isfinite(value)

    def _moe_groups(self) -> list[Any]:
        if not self.has_moe_params:
            return []
        from ds_engine._optional import require

        groups = require("ds_parallel", extra="parallel", feature="CheckOverflow with MoE parameters").groups
        return [groups._get_max_expert_parallel_group()]

    def _engine_reduces_in_backward(self) -> bool:
        engine = self.deepspeed
        if hasattr(engine, "pipeline_enable_backward_allreduce"):
            return bool(engine.pipeline_enable_backward_allreduce)
        return bool(getattr(engine, "enable_backward_allreduce", True))

    @staticmethod
    def _agree(local: bool, groups: list[Any]) -> bool:
        """MAX of the flag over each group in turn (None: the world); the local flag without a process group."""
        if not groups or not ds_comm.is_initialized():
            return local
        flag = torch.tensor([float(local)], device=_flag_device())
        for group in groups:
            ds_comm.all_reduce(flag, op=ds_comm.ReduceOp.MAX, group=group)
        return bool(flag.item())
