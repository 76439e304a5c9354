"""Module and autograd hooks that tell the coordinator when each module runs forward and backward.

* forward pre-hook (prepended, so user pre-hooks already see gathered parameters): gather the unit; wrap
  the inputs that require grad in `_PostBackward`, an identity whose backward runs once the module's
  backward has produced its input gradients, which is when its parameters can go;
* forward post-hook (`always_call`, so an exception still releases): register a multi-grad hook on the
  computed outputs that require grad (a plain tensor hook when there is one), which fires before the
  module's backward runs (gather again), then release, keeping any parameter in the output gathered for
  the caller.

The hooks run for every module of every forward, so their own cost shows on small modules: in eager mode
the pre-hook calls the coordinator directly, and only under `torch.compile` through the disabled
`_gather_for` (see there); a single-tensor call skips the pytree walk.

Inputs and outputs may be nested (tuples, lists, dicts, dataclasses registered with pytree) and may hold
non-tensors. A module whose inputs need no grad (the embedding at the bottom) has no post-backward signal;
the end-of-backward callback releases it. Modules without gather units only keep the module stack.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from ds_zero._schedule.coordinator import ParamCoordinator

logger = logging.getLogger(__name__)

__all__ = ["install_hooks"]


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs; its backward signals that the module's backward is done."""

    @staticmethod
    def forward(ctx: Any, coord: ParamCoordinator, module: nn.Module, *tensors: torch.Tensor) -> Any:
        ctx.coord = coord
        ctx.module = module
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.coord.post_backward(ctx.module)
        return (None, None, *grads)


def _grad_tensors(tree: Any) -> tuple[list[Any], Any, list[int]]:
    """The leaves of `tree`, its spec and the positions of the tensors that require grad."""
    flat, spec = tree_flatten(tree)
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    return flat, spec, idx


@torch.compiler.disable
def _gather_for(coord: ParamCoordinator, module: nn.Module) -> None:
    """`coord.pre_forward`, never traced: under `torch.compile` of the model the hook is a graph break here
    (the coordinator's gathers are collectives and bookkeeping, not graph ops; traced, every module's label
    string became a guard and the hook recompiled until dynamo's recompile limit, as DeepSpeed avoids with
    `torch.compiler.disable` on its own hooks)."""
    coord.pre_forward(module)


@torch.compiler.disable
def _release_after(coord: ParamCoordinator, module: nn.Module, output: Any) -> None:
    """`coord.post_forward`, never traced (see `_gather_for`)."""
    coord.post_forward(module, output)


_is_compiling = torch.compiler.is_compiling


def _pre_forward(
    coord: ParamCoordinator, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if _is_compiling():
        _gather_for(coord, module)
    else:  # eager: no need for the compiler's disable wrapper (a few microseconds a call, twice a module)
        coord.pre_forward(module)
    if not torch.is_grad_enabled() or not coord.gathers_for(module):
        return None
    if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # the common call, e.g. a Linear's
        if not args[0].requires_grad:
            return None
        return (_PostBackward.apply(coord, module, args[0])[0],), kwargs
    flat, spec, idx = _grad_tensors((args, kwargs))
    if not idx:
        return None
    wrapped = _PostBackward.apply(coord, module, *(flat[i] for i in idx))
    for i, t in zip(idx, wrapped, strict=True):
        flat[i] = t
    return tree_unflatten(flat, spec)


def _on_output_grad(coord: ParamCoordinator, module: nn.Module, grad: Any) -> None:
    coord.pre_backward(module)


def _post_forward(coord: ParamCoordinator, module: nn.Module, args: Any, output: Any) -> None:
    try:
        if output is not None and torch.is_grad_enabled() and coord.gathers_for(module):
            if isinstance(output, torch.Tensor):
                computed = [output] if output.grad_fn is not None else []
            else:
                flat, _, idx = _grad_tensors(output)
                # computed outputs only: a hook on a returned parameter (a leaf) would outlive this iteration
                # and fire in every later backward, and its gradient does not mean the module's backward is next
                computed = [flat[i] for i in idx if flat[i].grad_fn is not None]
            if len(computed) == 1 and not _is_compiling():  # its own hook fires once per backward, as "any" would
                computed[0].register_hook(functools.partial(_on_output_grad, coord, module))
            elif computed:
                torch.autograd.graph.register_multi_grad_hook(
                    computed, functools.partial(_on_output_grad, coord, module), mode="any"
                )
    finally:
        _release_after(coord, module, output)


def install_hooks(root: nn.Module, coord: ParamCoordinator) -> list[RemovableHandle]:
    """Hook every module of `root` (each instance once); returns the handles for removal."""
    handles: list[RemovableHandle] = []
    for module in root.modules():
        handles.append(
            module.register_forward_pre_hook(functools.partial(_pre_forward, coord), prepend=True, with_kwargs=True)
        )
        handles.append(module.register_forward_hook(functools.partial(_post_forward, coord), always_call=True))
    return handles
