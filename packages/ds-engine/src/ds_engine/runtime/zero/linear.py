"""`deepspeed.runtime.zero.linear`: DeepSpeed's ZeRO-3 linear layer, and its autocast decorators.

`LinearFunctionForZeroStage3` and `zero3_linear_wrap` are ds-zero's (one implementation, one object:
ds-zero installs it over `torch.nn.functional.linear` under `zero_optimization.memory_efficient_linear`,
see `ds_zero._construct.linear`), looked up on ds-zero when first asked for; without ds-zero that is an
ImportError naming `pip install 'ds-engine[zero]'`. `LinearModuleForZeroStage3` is `nn.Linear` computed
through that function.

`autocast_custom_fwd` / `autocast_custom_bwd` are torch's decorators bound to the accelerator's device
type (`functools.partial(torch.amp.custom_fwd, device_type=...)`); ds requires torch 2.4 or newer, so
there is no legacy `torch.cuda.amp` fallback.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_comm import get_accelerator

if TYPE_CHECKING:
    from ds_zero import LinearFunctionForZeroStage3, zero3_linear_wrap

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

_FROM_ZERO = frozenset({"LinearFunctionForZeroStage3", "zero3_linear_wrap"})


def __getattr__(name: str) -> Any:
    if name in _FROM_ZERO:
        from ds_engine._optional import require

        return getattr(require("ds_zero", extra="zero", feature=f"deepspeed.runtime.zero.linear.{name}"), name)
    raise AttributeError(f"module 'ds_engine.runtime.zero.linear' has no attribute {name!r}")


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
        from ds_zero import zero3_linear_wrap

        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
