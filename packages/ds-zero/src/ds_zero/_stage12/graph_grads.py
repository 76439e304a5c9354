"""Handing a stage-1/2 reducer's per-parameter duty from its autograd hooks to a compiled backward graph.

[Note: one owner per gradient] Eagerly, a parameter's gradient reaches the reducer through autograd:
`AccumulateGrad` writes `.grad` and the reducer's post-accumulate hook takes it (stage 2 copies it into
its bucket, stage 1 only notes that a backward ran, the gradient already sits in its flat-buffer view).
With DeepCompile the backward graph hands the gradient over itself (`ds_zero::reduce_grad`, placed right
after the node that produces it) and returns None for that parameter, so autograd accumulates nothing.
Autograd still runs the post-accumulate hook (with `.grad` untouched), so `hand_to_graph` records which
parameters the graph owns and stage 2's hook leaves those alone: otherwise it would take them a second
time. A stage-2 `.grad` present at that hook came from outside the graph (the parameter used outside the
compiled module); the graph's hand-over did not include it, so it is refused by name rather than reduced
twice or lost. At stage 1 an outside gradient adds into the same flat-buffer view as the graph's, which
is what autograd does eagerly, so nothing needs refusing there. `take_back_from_graph` (DeepCompile
falling back to eager) gives every parameter back to its hook.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

import ds_comm
from ds_zero._stage12.flat_buffer import FlatParamGroup

logger = logging.getLogger(__name__)

__all__ = ["GraphOwnedGrads"]


class GraphOwnedGrads:
    """Mixed into the stage-1/2 reducers: which parameters a compiled backward graph hands over itself."""

    flats: list[FlatParamGroup]
    _graph_owned: dict[int, str] | None = None  # id(param) -> its name, for the error
    _held: frozenset[int] | None = None  # ids of the flats' parameters (`holds`)

    def hand_to_graph(self, params: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """From now on the compiled backward delivers these `(name, parameter)`s' gradients (`accept_graph_grad`);
        their hooks must not see a gradient any more."""
        if self._graph_owned is None:
            self._graph_owned = {}
        for name, p in params:
            self._graph_owned[id(p)] = name

    def take_back_from_graph(self) -> None:
        """Every parameter's gradient goes through its eager hook again (DeepCompile fell back)."""
        if self._graph_owned:
            logger.info("ZeRO gradient hooks own %d parameters again", len(self._graph_owned))
        self._graph_owned = None

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param` is one of the trainable parameters this reducer reduces (the flats hold them, so their
        ids stay theirs; one set instead of a scan per call, which made a backend's set-up quadratic)."""
        if self._held is None:
            self._held = frozenset(id(p) for flat in self.flats for p in flat.params)
        return id(param) in self._held

    def owned_by_graph(self, param: torch.Tensor) -> bool:
        """Whether a compiled backward graph delivers `param`'s gradient."""
        return self._graph_owned is not None and id(param) in self._graph_owned

    def _hook_defers_to_graph(self, param: torch.Tensor) -> bool:
        """Whether `param`'s hook must leave it alone, the graph owning its gradient. Autograd still runs the
        hook after the graph returned None for it; a `.grad` present then came from outside the graph
        (see the module note) and is refused by name."""
        if self._graph_owned is None or id(param) not in self._graph_owned:
            return False
        if param.grad is not None:
            raise ds_comm.UsageError(
                f"parameter {self._graph_owned[id(param)]!r} received a gradient outside the DeepCompile backward "
                "graph that reduces it (is it used outside the compiled module?); use it only inside the module's "
                "forward, or compile without compile.deepcompile"
            )
        return True
