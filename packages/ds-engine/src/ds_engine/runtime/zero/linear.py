"""`deepspeed.runtime.zero.linear`: DeepSpeed's ZeRO-3 linear layer, and its autocast decorators.

DeepSpeed patches `torch.nn.functional.linear` with this autograd function inside `zero.Init` so
that backward re-gathers a weight that was partitioned after forward. ds-zero does not need the
patch: its saved-tensor hooks turn every saved view of a partitioned parameter into a marker that is
gathered again on unpack, whatever function saved it. The classes are kept for code that builds
`LinearModuleForZeroStage3` itself; they compute `y = x W^T + b` like `nn.Linear`, and under
`torch.autocast` they run forward and backward in the same autocast state (`torch.amp.custom_fwd` /
`custom_bwd`), as DeepSpeed's do.

`autocast_custom_fwd` / `autocast_custom_bwd` are those torch decorators bound to the accelerator's
device type (`functools.partial(torch.amp.custom_fwd, device_type=...)`); ds requires torch 2.4 or
newer, so there is no legacy `torch.cuda.amp` fallback.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from ds_comm import get_accelerator

__all__ = [
    "LinearFunctionForZeroStage3",
    "LinearModuleForZeroStage3",
    "autocast_custom_bwd",
    "autocast_custom_fwd",
    "zero3_linear_wrap",
]

_DEVICE_TYPE = get_accelerator().device_name()
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=_DEVICE_TYPE)
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=_DEVICE_TYPE)


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """`input @ weight.T + bias` with hand-written gradients; backward runs under forward's autocast state."""

    @staticmethod
    @autocast_custom_fwd
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())  # one fused kernel for the common case
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias  # in place: under autocast the result keeps matmul's dtype, as F.linear's does
        return output

    @staticmethod
    @autocast_custom_bwd
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            if grad_output.dim() == 1:  # a single sample: the outer product
                grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
            else:  # every leading dimension is a batch dimension
                grad_weight = (
                    grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
                )
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear`'s signature over `LinearFunctionForZeroStage3`."""
    result: torch.Tensor = LinearFunctionForZeroStage3.apply(input, weight, bias)  # type: ignore[no-untyped-call]
    return result


class LinearModuleForZeroStage3(nn.Module):
    """`nn.Linear` (same parameters, initialisation and result) computed by `LinearFunctionForZeroStage3`.

    Args:
        in_features: size of each input's last dimension.
        out_features: size of each output's last dimension.
        bias: learn an additive bias (default True).
    """

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """`nn.Linear`'s initialisation: Kaiming-uniform weight, bias uniform in +-1/sqrt(in_features)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
