"""DeepSpeed's stage-3 linear (`LinearFunctionForZeroStage3`, `zero3_linear_wrap`) and its process-wide install.

DeepSpeed computes linear layers under ZeRO-3 through an autograd function that saves the weight itself
(not the `weight.t()` view `F.linear` saves), so a weight released after forward can be re-gathered for
backward, and with `zero_optimization.memory_efficient_linear` (default true) it makes
`torch.nn.functional.linear` that function for the rest of the process. ds installs it the same way
(`install_zero3_linear`, called by `InsertPostInitMethodToModuleSubClasses`) because code written for
DeepSpeed observes it; ds-zero's saved-tensor hooks already re-gather saved weights for every op, so the
function is there for the contract, and it is made cheap:

- when autograd will not record (grad mode off, or no input requires grad) `zero3_linear_wrap` computes the
  values directly: no graph node is made either way, so nothing observable changes;
- otherwise the function is applied without `torch.autograd.Function.apply`'s per-call signature binding
  (all three arguments are always passed), unless a `torch.func` transform is active, which takes the
  full path (`generate_vmap_rule`, `setup_context`);
- the autocast device type is resolved once, and backward enters an autocast region only when forward
  ran under autocast or backward runs under it (otherwise the region would change nothing).

Measured (CPU time, one thread, min of 3 runs on a loaded 2-core machine; torch's linear = 1.00x):
forward+backward of an 8x64 by 64x64 linear 1.05x (1.76x before these changes), 256x1024 by 1024x1024
1.00x, 256x512 by 2048x512 1.03x (as before); a no-grad 8x64 by 64x64 forward 1.1x (6.4x before).

Values are DeepSpeed's (`deepspeed_linear_values`: the bias is added after the product for inputs of more
than 2 dims, so bf16 outputs can differ from an unpatched `F.linear`'s by an ulp and a ZeRO-3 run prints
DeepSpeed's losses), gradients come from linear's derivative (two matmuls and a sum), in forward's autocast
state as `torch.amp.custom_bwd` gives. `memory_efficient_linear: false` keeps torch's `F.linear`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._functorch import unwrap_if_dead
from torch.nn import functional

import ds_comm
from ds_zero._params.storage_pool import MIN_POOLED_BYTES, released_storages

__all__ = ["LinearFunctionForZeroStage3", "install_zero3_linear", "zero3_linear_wrap"]

_grad_enabled = torch.is_grad_enabled
_transforms_active = torch._C._are_functorch_transforms_active
_autocast_enabled = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype
_is_compiling = torch.compiler.is_compiling


def _resolve_device_type() -> tuple[str, bool]:
    """The accelerator's device type, and whether torch's autocast knows it (resolved once, at import)."""
    device_type = ds_comm.get_accelerator().device_name()
    try:
        torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):
        return device_type, False
    return device_type, True


_DEVICE_TYPE, _AUTOCAST_KNOWN = _resolve_device_type()


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """`input @ weight.T + bias` that saves `input`, `weight` and `bias` themselves for backward.

    Backward runs under the autocast state forward ran under (as `torch.amp.custom_bwd` would), so
    gradients come out in the dtypes forward produced. `generate_vmap_rule` lets `torch.func` transforms
    (`grad`, `vmap`) run through it. The ctx attributes `_device_type`, `_fwd_used_autocast` and `_dtype`
    are DeepSpeed's names (code inspecting `out.grad_fn` reads them).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002 - F.linear's names
        return deepspeed_linear_values(input, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx._device_type = _DEVICE_TYPE
        if _AUTOCAST_KNOWN:
            ctx._fwd_used_autocast, ctx._dtype = _autocast_enabled(_DEVICE_TYPE), _autocast_dtype(_DEVICE_TYPE)
        else:
            ctx._fwd_used_autocast, ctx._dtype = False, None
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # an autocast region only where it changes something: forward ran under autocast, or backward does
        if ctx._fwd_used_autocast or (_AUTOCAST_KNOWN and _autocast_enabled(_DEVICE_TYPE)):
            with torch.autocast(device_type=ctx._device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
                return _linear_grads(ctx, grad_out)
        return _linear_grads(ctx, grad_out)


def deepspeed_linear_values(
    input: torch.Tensor,  # noqa: A002 - F.linear's names
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`input @ weight.T + bias` computed as DeepSpeed's stage-3 linear computes it.

    A 2-D input with a bias is one fused multiply-add, as torch's linear; otherwise the product is formed
    (rounded to the tensor dtype) and the bias added after it. In fp32 that differs from torch's fused
    kernel by rounding only; in bf16/fp16 by up to an ulp of the output, enough to move a printed bf16
    loss, so ZeRO-3 runs reproduce DeepSpeed's losses rather than an unpatched `F.linear`'s.
    """
    if bias is None or input.dim() != 2:
        out = input.matmul(weight.t())
        return out if bias is None else out.add_(bias)
    return torch.addmm(bias, input, weight.t())


def _linear_grads(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `input @ weight.T + bias` for the inputs that need one."""
    input, weight, bias = ctx.saved_tensors  # noqa: A001
    needs_input, needs_weight, needs_bias = ctx.needs_input_grad
    grad_input = grad_weight = grad_bias = None
    if needs_input:
        grad_input = grad_out.matmul(weight)
    if grad_out.dim() == 1:
        if needs_weight:
            grad_weight = grad_out.unsqueeze(-1) * input.unsqueeze(0)
        if bias is not None and needs_bias:
            grad_bias = grad_out
    else:
        if grad_out.dim() > 2:
            grad_out = grad_out.reshape(-1, grad_out.shape[-1])
            input = input.reshape(-1, input.shape[-1])  # noqa: A001
        if needs_weight:
            grad_weight = _weight_grad(ctx, grad_out, input)
        if bias is not None and needs_bias:
            grad_bias = grad_out.sum(0)
    return grad_input, grad_weight, grad_bias


def _weight_grad(ctx: Any, grad_out: torch.Tensor, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """`grad_out.T @ input`, on the memory of a released full storage of the same size when there is one.

    A large weight's gradient is a fresh block of the weight's size in every backward; on the host that is
    new pages the kernel faults in and zero-fills (an 8192x8192 bf16 gradient: 58 ms to compute into new
    memory, 15 ms into reused memory). The stage-3 reducer hands the block back once it has taken the
    gradient (`_stage3.grads`), so the next layer's gradient reuses it (see [Note: why released full
    storages are pooled]). Same kernel, same values; not under autocast, whose output dtype is its own.
    """
    shape = (grad_out.shape[1], input.shape[1])
    if (
        shape[0] * shape[1] * grad_out.element_size() >= MIN_POOLED_BYTES  # small ones: not worth a lookup
        and not _is_compiling()  # traced (DeepCompile, torch.compile): the graph allocates its own output
        and not ctx._fwd_used_autocast
        and grad_out.dtype == input.dtype
        and grad_out.device.type == "cpu"
    ):
        out = released_storages.empty(shape, grad_out.dtype)
        if out is not None:
            return torch.mm(grad_out.t(), input, out=out)
    return grad_out.t().mm(input)


#: `torch.autograd.Function.apply` without its per-call signature binding (see the module docstring).
_apply_unbound = super(torch.autograd.Function, LinearFunctionForZeroStage3).apply


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002 - F.linear's names
    """`torch.nn.functional.linear(input, weight, bias)` through `LinearFunctionForZeroStage3` (DeepSpeed's drop-in).

    When autograd would record nothing, the values are computed directly (the same values, no graph node).
    """
    if not _grad_enabled() or not (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return deepspeed_linear_values(input, weight, bias)
    if _transforms_active():
        result: torch.Tensor = LinearFunctionForZeroStage3.apply(input, weight, bias)  # type: ignore[no-untyped-call]
        return result
    # what Function.apply does before it reaches the C++ apply: unwrap tensors of a finished transform
    result = _apply_unbound(
        unwrap_if_dead(input), unwrap_if_dead(weight), None if bias is None else unwrap_if_dead(bias)
    )
    return result


def install_zero3_linear(backup_holder: type) -> None:
    """Make `torch.nn.functional.linear` `zero3_linear_wrap` for the rest of the process (DeepSpeed's install).

    The original is stored once as `backup_holder.linear_bk`; `F.linear` is replaced only while it is
    still that original (idempotent, and a wrapper someone installed over it stays).
    """
    if not hasattr(backup_holder, "linear_bk"):
        backup_holder.linear_bk = functional.linear  # type: ignore[attr-defined]
    if functional.linear is backup_holder.linear_bk:  # type: ignore[attr-defined]
        functional.linear = zero3_linear_wrap
