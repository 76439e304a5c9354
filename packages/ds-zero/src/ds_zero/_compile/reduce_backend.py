"""The torch.compile backend for ZeRO stages 1/2 that places each gradient's reduction in the backward graph.

DeepSpeed's `zero1_compile` / `zero2_compile` passes (`add_z1_reduce` / `add_z2_reduce`) put a reduce op
right after the node that produces each parameter's gradient in the AOTAutograd backward graph, so the
graph, not an autograd hook, schedules the hand-over and it overlaps the rest of the backward. ds does the
same with its own op (`ds_zero::reduce_grad`, `reduce_ops`): Dynamo's graph has the module's parameters
as placeholders, recognized by identity with the example inputs (or the source Dynamo recorded);
AOTAutograd's backward graph returns one gradient per forward input, in input order, so the gradient of
the parameter at input `i` is output `i`. `place_reductions` inserts `reduce_grad(grad, param_index)`
right after that output's producing node and makes the graph return None in its place, so autograd
neither accumulates it nor runs the reducer's hook: the reducer receives each gradient once, from the
graph (`ds_zero._stage12.graph_grads` records that the graph owns it). The graphs then go to inductor's
`compile_fx_inner` (`inner="inductor"`) or run as FX code (`inner="eager"`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import fx, nn

from ds_zero._compile.backend import compile_graph
from ds_zero._compile.reduce_ops import GradSink, register_param

logger = logging.getLogger(__name__)

__all__ = ["PlacedReduction", "ReduceGradBackend", "ReduceSchedule", "place_reductions"]

REDUCE = "ds_zero::reduce_grad"


@dataclasses.dataclass(frozen=True)
class PlacedReduction:
    """One `reduce_grad` the pass placed: its position in the backward graph and the node it follows."""

    position: int
    name: str
    param_index: int
    anchor: str  # the node that produces the gradient

    def __str__(self) -> str:
        return f"{self.position:4d} reduce  {self.name} (param_index={self.param_index}) after {self.anchor}"


@dataclasses.dataclass
class ReduceSchedule:
    """The reductions placed per compiled backward graph ("backward 0", ...), in graph order."""

    graphs: dict[str, list[PlacedReduction]] = dataclasses.field(default_factory=dict)

    def lines(self) -> list[str]:
        out: list[str] = []
        for name, items in self.graphs.items():
            out.append(f"{name}: {len(items)} gradient reductions")
            out.extend(f"  {item}" for item in items)
        return out


def place_reductions(
    gm: fx.GraphModule, positions: dict[int, int], names: dict[int, str], *, num_inputs: int
) -> list[PlacedReduction]:
    """Insert `reduce_grad` after each listed gradient of backward graph `gm` and return None in its place.

    Args:
        gm: an AOTAutograd backward graph, whose output holds one gradient per forward input.
        positions: forward input position -> the `param_index` of the parameter there.
        names: `param_index` -> the parameter's name (for the schedule).
        num_inputs: how many inputs the forward graph has (checked against the outputs).

    Raises:
        RuntimeError: the graph's outputs do not line up with the forward's inputs.
    """
    import torch

    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    grads = list(output.args[0])  # type: ignore[arg-type,unused-ignore]
    if len(grads) != num_inputs:
        raise RuntimeError(
            f"DeepCompile: the backward graph returns {len(grads)} gradients for {num_inputs} forward inputs; "
            "cannot tell which gradient is which parameter's"
        )
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    placed: list[tuple[fx.Node, int, fx.Node]] = []
    for pos, key in sorted(positions.items()):
        grad = grads[pos]
        if not isinstance(grad, fx.Node):
            continue  # no gradient for it in this graph
        after = last_input if grad.op == "placeholder" else grad
        with graph.inserting_after(after):
            node = graph.call_function(torch.ops.ds_zero.reduce_grad.default, (grad, key))
        node.meta["val"] = None
        grads[pos] = None
        placed.append((node, key, grad))
    output.args = (tuple(grads),)
    graph.lint()
    gm.recompile()
    order = {n: i for i, n in enumerate(graph.nodes)}
    items = [PlacedReduction(order[n], names.get(k, "?"), k, g.name) for n, k, g in placed]
    return sorted(items, key=lambda item: item.position)


class ReduceGradBackend:
    """A torch.compile backend for a module trained with ds-zero's stage-1/2 optimizer.

    Args:
        module: the module the optimizer's parameters belong to (matched to Dynamo's placeholders).
        sink: the optimizer's gradient reducer (`DeepSpeedZeroOptimizer.graph_gradients()`).
        inner: "inductor" (native code) or "eager" (the graphs run as Python).
        debug_log: log each backward graph's reductions at INFO (otherwise DEBUG).
    """

    def __init__(
        self,
        module: nn.Module,
        sink: GradSink,
        *,
        inner: Literal["inductor", "eager"] = "inductor",
        debug_log: bool = False,
    ) -> None:
        self.sink = sink
        self.inner = inner
        self.debug_log = debug_log
        self.schedule = ReduceSchedule()
        self.graph_count = 0
        self._keys: dict[int, int] = {}  # id(param) -> param_index
        self._names: dict[int, str] = {}  # param_index -> name
        self._params: dict[int, nn.Parameter] = {}  # param_index -> param
        for name, p in module.named_parameters():
            if p.requires_grad and sink.holds(p) and id(p) not in self._keys:
                key = register_param(p, sink)
                self._keys[id(p)] = key
                self._names[key] = name
                self._params[key] = p

    def _positions(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, int]:
        found: dict[int, int] = {}
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for pos, (node, example) in enumerate(zip(inputs, example_inputs, strict=False)):
            key = self._keys.get(id(example))
            if key is None:
                grapharg = node.meta.get("grapharg")
                key = self._keys.get(id(getattr(grapharg, "example", None))) if grapharg is not None else None
            if key is not None:
                found[pos] = key
        return found

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        number = self.graph_count
        self.graph_count += 1
        positions = self._positions(gm, example_inputs)
        logger.debug("DeepCompile: graph %d has %d ZeRO-1/2 parameters", number, len(positions))

        def compiler(label: str, graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            if label == "backward":
                placed = place_reductions(graph, positions, self._names, num_inputs=len(example_inputs))
                self.sink.hand_to_graph((self._names[p.param_index], self._params[p.param_index]) for p in placed)
                key = f"backward {number}"
                self.schedule.graphs[key] = placed
                log = logger.info if self.debug_log else logger.debug
                for line in ReduceSchedule({key: placed}).lines():
                    log("DeepCompile schedule: %s", line)
            return compile_graph(self.inner, graph, inputs, backward=label == "backward")

        kwargs: dict[str, Any] = {
            "fw_compiler": functools.partial(compiler, "forward"),
            "bw_compiler": functools.partial(compiler, "backward"),
        }
        if self.inner == "inductor":
            from torch._functorch.partitioners import min_cut_rematerialization_partition
            from torch._inductor.decomposition import select_decomp_table

            kwargs["decompositions"] = select_decomp_table()
            kwargs["partition_fn"] = min_cut_rematerialization_partition
            kwargs["keep_inference_input_mutations"] = True
        return aot_autograd(**kwargs)(gm, example_inputs)
