"""Counting floating-point operations per module with a `TorchDispatchMode`.

[Note: why a dispatch mode] Every tensor operation reaches the dispatcher as an aten op, whichever
way the model wrote it (`F.linear`, `x @ w`, a tensor method, a fused kernel), so counting there
needs no patching of `torch.nn.functional` or tensor methods (DeepSpeed's approach, which misses
what it did not patch and leaves the patches in place if a profile is not ended) and also sees the
backward pass. The matrix-multiply, convolution and attention formulas are torch's own
(`torch.utils.flop_counter.flop_registry`, 2 flops per multiply-accumulate); torch's
`FlopCounterMode` is not used as is because it attributes counts to module names only, keeps no
latency, and has no formula for the CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu`,
counted as 0), which is added here. Elementwise ops count one flop per output element (layer norm
five, as DeepSpeed counts them) and no MACs; MACs come from the matrix-class ops only.

Attribution: a forward pre-hook pushes a module, its forward hook pops it, and in the forward phase
each op is charged to the innermost module on the stack (ops outside the model, such as a loss
computed by the script, are not counted); a module's total is the sum over its subtree. In the
backward phase (the engine's `backward`) every op goes to the backward totals, recomputed
forwards of activation checkpointing included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["OpCounter", "model_params", "warm_up_dispatch"]

aten = torch.ops.aten

_ELEMENTWISE = {
    getattr(aten, name)
    for name in (
        "add", "sub", "mul", "div", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "reciprocal",
        "relu", "gelu", "silu", "tanh", "sigmoid", "elu", "leaky_relu", "hardtanh", "prelu",
        "threshold_backward", "gelu_backward", "silu_backward", "tanh_backward", "sigmoid_backward",
        "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    )
    if hasattr(aten, name)
}  # fmt: skip


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0].numel()
    return 0


def _cpu_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_sdpa_backward(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> int:
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


_EXTRA_MATRIX: dict[Any, Callable[..., int]] = {}
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_MATRIX[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
    _EXTRA_MATRIX[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_backward


def count_op(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    """(flops, MACs) of one aten op call."""
    if packet in flop_registry:
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        return flops, flops // 2
    if packet in _EXTRA_MATRIX:
        flops = _EXTRA_MATRIX[packet](*args, **kwargs)
        return flops, flops // 2
    if packet in _ELEMENTWISE:
        return _numel(out), 0
    if packet is aten.native_layer_norm:
        affine = len(args) > 2 and args[2] is not None
        return _numel(args[0]) * (5 if affine else 4), 0
    return 0, 0


class OpCounter(TorchDispatchMode):
    """Charges each op's (flops, MACs) to the innermost module on `stack` (forward phase) or to the
    backward totals (`backward = True`).

    Args:
        stack: the profiler's module stack (pushed and popped by its forward hooks).
        add: `add(module, flops, macs)` for ops inside a module.
        add_backward: `add_backward(flops, macs)` for ops in the backward phase (None: dropped).
    """

    def __init__(
        self,
        stack: list[torch.nn.Module],
        add: Callable[[torch.nn.Module, int, int], None],
        add_backward: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__()
        self.stack = stack
        self.add = add
        self.add_backward = add_backward
        self.backward = False

    def start(self) -> None:
        """Enter the mode (counting starts); `stop()` leaves it. Not nested with itself."""
        self.__enter__()  # type: ignore[no-untyped-call]

    def stop(self) -> None:
        self.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops, macs = count_op(func._overloadpacket, args, kwargs, out)
        if flops or macs:
            if self.backward:
                if self.add_backward is not None:
                    self.add_backward(flops, macs)
            elif self.stack:
                self.add(self.stack[-1], flops, macs)
        return out


_warmed = False


def warm_up_dispatch() -> None:
    """Enter a dispatch mode once per process before timing anything: the first entry imports
    `torch._dynamo` (seconds), which would otherwise land in the first profiled module's latency."""
    global _warmed
    if _warmed:
        return
    with OpCounter([], lambda module, flops, macs: None):
        torch.ones(1) + 1
    _warmed = True


def model_params(module: torch.nn.Module) -> int:
    """Parameters of `module` and its children (a ZeRO-3 partitioned parameter counts its full size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())
