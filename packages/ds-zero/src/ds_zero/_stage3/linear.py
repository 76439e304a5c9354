"""DeepSpeed's stage-3 linear: `LinearFunctionForZeroStage3` and `zero3_linear_wrap`.

DeepSpeed computes linear layers under ZeRO-3 through an autograd function that saves the weight itself
(not the `weight.t()` view `F.linear` saves), so a released weight can be re-gathered for backward, and
patches `torch.nn.functional.linear` with it process-wide. ds does not patch (see `_stage3.init_base`):
every tensor autograd saves from a partitioned parameter's storage is re-gathered on unpack (the
saved-tensor net, `_stage3.saved_tensors`), whatever the op. The function is here for code that calls
it or builds DeepSpeed's `LinearModuleForZeroStage3`: its values come from torch's own linear kernel
(bit-identical to `F.linear`), its gradients from the matmuls of linear's derivative.
"""

from __future__ import annotations

from typing import Any

import torch

import ds_comm

__all__ = ["LinearFunctionForZeroStage3", "zero3_linear_wrap"]

#: torch's linear kernel binding; `F.linear` is this object until something replaces it.
_aten_linear = torch._C._nn.linear


def _autocast_state() -> tuple[str, bool, torch.dtype | None]:
    device_type = ds_comm.get_accelerator().device_name()
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):  # a device type torch's autocast does not know
        return device_type, False, None


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """`input @ weight.T + bias` that saves `input`, `weight` and `bias` for backward.

    Backward runs under the autocast state the forward ran under (as `torch.amp.custom_bwd` would), so
    gradients come out in the dtypes forward produced. `generate_vmap_rule` lets `torch.func` transforms
    (`grad`, `vmap`) run through it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002 - F.linear's names
        # torch's own kernel (whatever F.linear is now): bit-identical values to an unpatched F.linear
        return _aten_linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        input, weight = inputs[0], inputs[1]  # noqa: A001
        bias = inputs[2] if len(inputs) > 2 else None
        # DeepSpeed's ctx attribute names (code inspecting `out.grad_fn` reads them)
        ctx._device_type, ctx._fwd_used_autocast, ctx._dtype = _autocast_state()
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.autocast(device_type=ctx._device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
            input, weight, bias = ctx.saved_tensors  # noqa: A001
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_out.matmul(weight)
            if ctx.needs_input_grad[1]:
                if grad_out.dim() == 1:
                    grad_weight = grad_out.unsqueeze(-1) * input.unsqueeze(0)
                else:
                    grad_weight = (
                        grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
                    )
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_out if grad_out.dim() == 1 else grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(
    input: torch.Tensor,  # noqa: A002 - F.linear's names
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(input, weight, bias)` through `LinearFunctionForZeroStage3` (DeepSpeed's drop-in)."""
    return LinearFunctionForZeroStage3.apply(input, weight, bias)
