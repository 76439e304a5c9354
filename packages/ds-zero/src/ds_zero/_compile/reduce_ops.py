"""`ds_zero::reduce_grad`: the op a DeepCompile backward graph hands a ZeRO-1/2 gradient to its reducer with.

`reduce_grad(grad, param_index)` runs right after the node that produces the gradient of the parameter
registered under `param_index` (`register_param`), and gives `grad` to that parameter's stage-1/2 reducer
(`GradSink.accept_graph_grad`) exactly where its eager hook would have taken `.grad`: stage 2 copies it
into its bucket and launches the buckets now complete (reduce-scatter during backward, into this rank's
gradient partition, every micro-step), stage 1 adds it to the parameter's view of the flat gradient
buffer, which `step()` reduces at the accumulation boundary. It returns nothing and is marked
side-effecting, so no dead-code elimination removes it; the graph returns None for the parameter, so
autograd does not accumulate the gradient a second time (`ds_zero._stage12.graph_grads`).

Parameters are found by an integer key in a registry of weak references, so the graph carries only
integers besides the gradients, as the stage-3 ops do.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

__all__ = ["GradSink", "ReduceStats", "reduce_grad", "reduce_stats", "register_param"]


class GradSink(Protocol):
    """What a stage-1/2 gradient reducer offers a compiled backward graph (`ds_zero._stage12.graph_grads`)."""

    def hand_to_graph(self, params: Iterable[tuple[str, nn.Parameter]]) -> None: ...

    def take_back_from_graph(self) -> None: ...

    def owned_by_graph(self, param: torch.Tensor) -> bool: ...

    def holds(self, param: torch.Tensor) -> bool: ...

    def accept_graph_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None: ...


@dataclasses.dataclass
class ReduceStats:
    """How many gradients the graphs handed to a reducer (reset with `reset()`): what a test checks."""

    reductions: int = 0

    def reset(self) -> None:
        self.reductions = 0


reduce_stats = ReduceStats()

_TARGETS: dict[int, tuple[weakref.ReferenceType[GradSink], weakref.ReferenceType[nn.Parameter]]] = {}
_KEYS = itertools.count()


def register_param(param: nn.Parameter, sink: GradSink) -> int:
    """Make `param`'s reducer reachable from `reduce_grad`; returns the `param_index` the graph passes."""
    key = next(_KEYS)
    _TARGETS[key] = (weakref.ref(sink), weakref.ref(param))
    return key


@torch.library.custom_op("ds_zero::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, param_index: int) -> None:
    sink_ref, param_ref = _TARGETS.get(param_index, (None, None))
    sink = sink_ref() if sink_ref is not None else None
    param = param_ref() if param_ref is not None else None
    if sink is None or param is None:
        raise RuntimeError(f"DeepCompile: no ZeRO-1/2 parameter is registered under param_index={param_index}")
    sink.accept_graph_grad(param, grad)
    reduce_stats.reductions += 1


@reduce_grad.register_fake
def _(grad: torch.Tensor, param_index: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.ds_zero.reduce_grad.default)
