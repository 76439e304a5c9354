"""Domino's tensor-parallel linears (DeepSpeed's `deepspeed.runtime.domino.async_linear`).

Domino overlaps tensor-parallel communication with compute by running two halves of the batch through the
layers in turn, so one half's all-reduce runs while the other half computes. Its linears therefore leave
communication to the caller:

- `DominoAsyncColumnParallelLinear` (weight rows sharded): forward needs no communication; backward starts
  the all-reduce of the input gradient *asynchronously* and parks its handle in `handle_dic[h_id]`. The
  matching wait sits upstream (`_Wait_bwd_comm`, right after the layer norm that feeds this linear), so the
  other half's backward computes while the reduction is in flight.
- `RowParallelLinearNoComm` (weight columns sharded): a plain linear on this rank's shard; the caller
  all-reduces the partial output itself (asynchronously, see `transformer`).

Both return `(output, bias)`: with `skip_bias_add` the bias is not added but handed back, so it is added once
after the reduction (a row-parallel bias added on every rank would be summed tp times).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from ds_comm import get_accelerator

logger = logging.getLogger(__name__)

__all__ = [
    "DominoAsyncColumnParallelLinear",
    "DominoAsyncColumnParallelLinearImpl",
    "RowParallelLinearNoComm",
    "TP_group",
    "start_all_reduce",
]

#: The tensor-parallel group of the first Domino column linear built (DeepSpeed keeps it module-wide);
#: each linear here uses the group it was built with.
TP_group: ProcessGroup | None = None


def start_all_reduce(tensor: Tensor, group: ProcessGroup | None) -> Any:
    """Start summing `tensor` in place over `group`; the handle to wait on, or None with one rank (nothing
    to do). Nothing may read `tensor` before the handle's `wait()`.

    The sum runs on `tensor`'s data outside autograd: a partial sum's gradient is the sum's (every rank
    computes the same downstream gradient), so the backward of the reduction is the identity.
    """
    if group is None or dist.get_world_size(group) == 1:
        return None
    return dist.all_reduce(tensor.detach(), group=group, async_op=True)


class DominoAsyncColumnParallelLinearImpl(torch.autograd.Function):
    """`input @ weight.T + bias`; the backward's input gradient is all-reduced asynchronously (handle in
    `handle_dic[h_id]`), the weight and bias gradients are local."""

    @staticmethod
    def forward(
        ctx: Any,
        inp: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        handle_dic: MutableMapping[Any, Any],
        h_id: Any,
        group: ProcessGroup | None = None,
    ) -> Tensor:
        ctx.save_for_backward(inp, weight)
        ctx.has_bias = bias is not None
        ctx.handle_dic, ctx.h_id = handle_dic, h_id
        ctx.group = group if group is not None else TP_group
        out = torch.matmul(inp, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        inp, weight = ctx.saved_tensors
        grad_input = torch.matmul(grad_output, weight)
        # Started before the weight gradient is computed, so that matmul already overlaps the reduction.
        ctx.handle_dic[ctx.h_id] = start_all_reduce(grad_input, ctx.group)
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = flat_grad.t().matmul(inp.reshape(-1, inp.shape[-1]))
        grad_bias = flat_grad.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


def _parameter(shape: tuple[int, ...], config: Any, init: Callable[[Tensor], Any] | None) -> nn.Parameter:
    param = nn.Parameter(
        torch.empty(*shape, device=get_accelerator().current_device_name(), dtype=getattr(config, "params_dtype", None))
    )
    if getattr(config, "perform_initialization", True):
        with torch.no_grad():
            if init is not None:
                init(param)
            else:
                param.zero_()
    return param


class DominoAsyncColumnParallelLinear(nn.Module):
    """A column-parallel linear whose backward all-reduce is asynchronous (see the module docstring).

    Args:
        input_size: full input width.
        output_size: this rank's share of the output width.
        _tp_group: the tensor-parallel group.
        config: Megatron-style config (`params_dtype`, `perform_initialization`).
        init_method: initializes the weight in place.
        bias: learn a bias (zero-initialised).
        skip_bias_add: return the bias instead of adding it.

    `forward(input_, handle_dic, h_id)` returns `(output, bias or None)`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        _tp_group: ProcessGroup | None,
        config: Any,
        init_method: Callable[[Tensor], Any],
        bias: bool = True,
        skip_bias_add: bool = False,
    ) -> None:
        super().__init__()
        global TP_group
        if TP_group is None:
            TP_group = _tp_group
        self.tp_group = _tp_group
        self.skip_bias_add = skip_bias_add
        self.weight = _parameter((output_size, input_size), config, init_method)
        self.bias = _parameter((output_size,), config, None) if bias else None

    def forward(self, input_: Tensor, handle_dic: MutableMapping[Any, Any], h_id: Any) -> tuple[Tensor, Any]:
        bias = None if self.skip_bias_add else self.bias
        out = DominoAsyncColumnParallelLinearImpl.apply(  # type: ignore[no-untyped-call]
            input_, self.weight, bias, handle_dic, h_id, self.tp_group
        )
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinearNoComm(nn.Module):
    """A row-parallel linear that leaves the all-reduce of its partial output to the caller.

    Args as `DominoAsyncColumnParallelLinear` (no group; `stride` is accepted, as DeepSpeed's, and unused).
    `forward(input_)` returns `(partial output, bias or None)`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        config: Any,
        init_method: Callable[[Tensor], Any],
        bias: bool = True,
        stride: int = 1,
        skip_bias_add: bool = False,
    ) -> None:
        super().__init__()
        self.skip_bias_add = skip_bias_add
        self.weight = _parameter((output_size, input_size), config, init_method)
        self.bias = _parameter((output_size,), config, None) if bias else None

    def forward(self, input_: Tensor) -> tuple[Tensor, Any]:
        bias = None if self.skip_bias_add else self.bias
        out = nn.functional.linear(input_, self.weight, bias)
        return out, (self.bias if self.skip_bias_add else None)
