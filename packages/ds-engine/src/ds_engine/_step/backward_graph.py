"""Questions about the backward pass that is running now, asked from inside one of its hooks.

A gradient hook that waits for "all gradients of this step" needs to know how many parameters the
current backward will actually reach: a parameter whose branch was not used in forward, or that
the `inputs=` of `torch.autograd.backward` leaves out, never fires its hook. The autograd engine
knows which nodes of the graph task it will execute; this module asks it, per parameter, through
the gradient accumulator node of each leaf (or the grad_fn of a non-leaf).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["count_used_parameters_in_backward"]


_Queries = tuple[Callable[[torch.Tensor], Any], Callable[[Any], bool], Callable[[], int]]


def _engine_queries() -> _Queries:
    """torch's (grad-node lookup, will-execute query, graph task id), or an error naming what is missing."""
    lookup: Any = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", None)
    will_execute: Any = getattr(torch._C, "_will_engine_execute_node", None)
    task_id: Any = getattr(torch._C, "_current_graph_task_id", None)
    missing = [
        name
        for name, api in (
            ("torch.autograd.graph._get_grad_fn_or_grad_acc", lookup),
            ("torch._C._will_engine_execute_node", will_execute),
            ("torch._C._current_graph_task_id", task_id),
        )
        if api is None
    ]
    if missing:
        raise RuntimeError(
            f"count_used_parameters_in_backward needs autograd-engine queries this torch {torch.__version__} "
            f"lacks: {', '.join(missing)}"
        )
    return lookup, will_execute, task_id


def count_used_parameters_in_backward(parameters: Iterable[torch.Tensor]) -> int:
    """How many of `parameters` the running backward pass will produce a gradient for.

    Call it from a hook that runs during backward (a tensor or module backward hook). Parameters
    that do not require grad, and several parameters sharing one gradient node, are counted once
    at most; a parameter outside the graph or pruned by `backward(inputs=...)` is not counted.

    Raises:
        RuntimeError: called outside a backward pass, or the installed torch lacks the engine queries.
    """
    lookup, will_execute, task_id = _engine_queries()
    if task_id() == -1:
        raise RuntimeError(
            "count_used_parameters_in_backward must be called during backward (from a gradient or backward "
            "hook); no backward pass is running"
        )
    nodes = []
    seen: set[int] = set()
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        # Hooks run with grad mode off; the lookup of a leaf's accumulator needs it on.
        with torch.enable_grad():
            node = lookup(param)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
    return sum(1 for node in nodes if will_execute(node))
