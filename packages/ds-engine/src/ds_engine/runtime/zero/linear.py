"""`deepspeed.runtime.zero.linear`: DeepSpeed's ZeRO-3 linear layer, and its autocast decorators.

DeepSpeed patches `torch.nn.functional.linear` with this autograd function (process-wide, from
`zero.Init` on) so that backward re-gathers a weight that was partitioned after forward. ds-zero does
not need the patch and does not apply it: its saved-tensor hooks turn every saved view of a partitioned
parameter into a marker that is gathered again on unpack, whatever function saved it. The classes are
kept for code that calls them or builds `LinearModuleForZeroStage3` itself: values come from torch's own
linear kernel (bit-identical to `F.linear`), gradients from linear's derivative, backward runs in
forward's autocast state (what `torch.amp.custom_fwd` / `custom_bwd` give), and `torch.func`
transforms run through them.

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


#: torch's linear kernel binding; `F.linear` is this object until something replaces it.
_aten_linear = torch._C._nn.linear


def _autocast_state() -> tuple[str, bool, torch.dtype | None]:
    device_type = _DEVICE_TYPE  # the device type the decorators above are bound to, resolved once
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
