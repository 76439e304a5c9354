"""The torch.compile backend that turns a captured ZeRO-3 forward into a gather/release schedule.

Dynamo hands the backend its graph with the module's parameters lifted to placeholders. The backend
recognizes the partitioned ones (non-persistent stage-3 parameters, by identity with the example inputs
or by the source Dynamo recorded), routes their uses through `allgather_param`, and compiles the result
with AOTAutograd: the joint graph's gathers are tagged for recomputation, the min-cut partitioner splits
forward and backward, `schedule_gathers` places each graph's gathers and releases, and `overlap_gathers`
turns them into bucketed asynchronous starts issued one bucket ahead and waits at the first use. The
graphs then go to inductor's `compile_fx_inner` (`inner="inductor"`, native code on CPU or CUDA) or run
as FX code (`inner="eager"`, for quick checks of the schedule); that code takes its inputs boxed and drops
each after its last use, as inductor's does, so a backward graph frees its saved activations as it goes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import fx, nn

from ds_zero._compile import passes
from ds_zero._compile.ops import register_params
from ds_zero._compile.overlap import overlap_gathers
from ds_zero._params.partitioned_param import is_zero_param

logger = logging.getLogger(__name__)

__all__ = ["DeepCompileBackend", "Schedule", "compile_graph"]


@dataclasses.dataclass
class Schedule:
    """What the passes placed, per compiled graph ("forward 0", "backward 0", ...), in graph order."""

    graphs: dict[str, list[passes.ScheduledOp]] = dataclasses.field(default_factory=dict)

    def max_gathered(self, graph: str) -> int:
        """The most parameters `graph` holds gathered at once: each counts from its start (or its blocking
        gather) to its release, in graph order; a gathered value the graph returns is never released."""
        live: set[int] = set()
        most = 0
        for item in self.graphs[graph]:
            if item.kind in ("prefetch", "gather"):
                live.add(item.ds_id)
            else:
                live.discard(item.ds_id)
            most = max(most, len(live))
        return most

    def lines(self, first_graph: int = 0, end_graph: int | None = None) -> list[str]:
        """The dump of the graphs numbered `first_graph` up to (not including) `end_graph` (default: all)."""
        out: list[str] = []
        for name, items in self.graphs.items():
            number = int(name.rsplit(" ", 1)[1])
            if number < first_graph or (end_graph is not None and number >= end_graph):
                continue
            starts = {i.position for i in items if i.kind == "prefetch"}
            out.append(
                f"{name}: {sum(i.kind == 'gather' for i in items)} gathers, "
                f"{sum(i.kind == 'release' for i in items)} releases, "
                f"{len(starts)} asynchronous collectives, at most {self.max_gathered(name)} gathered at once"
            )
            out.extend(f"  {item}" for item in items)
        return out


class DeepCompileBackend:
    """A torch.compile backend for a module whose parameters ds-zero stage 3 partitioned.

    Args:
        module: the partitioned module (its parameters are matched to Dynamo's placeholders).
        inner: "inductor" (native code) or "eager" (the scheduled FX graphs run as Python).
        prefetch: how many graph nodes before its first user each gather is placed.
        overlap: gathers are bucketed and started this many buckets ahead of their use (0: bucketed, no
            overlap; None: each gather a blocking collective in its place).
        debug_log: log each graph's schedule at INFO (otherwise DEBUG).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        inner: Literal["inductor", "eager"] = "inductor",
        prefetch: int = 0,
        overlap: int | None = 1,
        debug_log: bool = False,
    ) -> None:
        self.inner = inner
        self.prefetch = prefetch
        self.overlap = overlap
        self.debug_log = debug_log
        self.schedule = Schedule()
        self.graph_count = 0
        self._names: dict[int, str] = {}
        self._by_id: dict[int, nn.Parameter] = {}
        self._keys: dict[int, tuple[int, Any]] = {}  # what one bucket's parameters share
        for name, p in module.named_parameters():
            if is_zero_param(p) and not p.ds_persist:
                self._names[int(p.ds_id)] = name
                self._by_id[id(p)] = p
                self._keys[int(p.ds_id)] = (id(p.ds_process_group), p.dtype)
        register_params(self._by_id.values())

    @property
    def param_names(self) -> dict[int, str]:
        return dict(self._names)

    def stop_gathering(self, params: Sequence[nn.Parameter]) -> Callable[..., Any]:
        """Leave `params` (now kept whole, see `_compile.selective`) out of the graphs compiled from here on.

        Returns the backend to recompile the module with: a new callable over this object, so Dynamo,
        which caches a frame's graphs per backend, compiles the module's frames again (the graphs compiled
        so far gather these parameters); the schedule and the graph numbers go on from this object's.
        """
        for p in params:
            self._names.pop(int(p.ds_id), None)
            self._keys.pop(int(p.ds_id), None)
            self._by_id.pop(id(p), None)
        return self.fresh()

    def with_overlap(self, overlap: int | None) -> Callable[..., Any]:
        """Place the gathers of the graphs compiled from here on with `overlap` (see the class); returns the
        backend to recompile the module with, as `stop_gathering` does."""
        if overlap is not None and overlap < 0:
            raise ValueError(f"DeepCompileBackend.with_overlap({overlap}): must be None or >= 0")
        self.overlap = overlap
        return self.fresh()

    def fresh(self) -> Callable[..., Any]:
        """A new callable over this object: Dynamo caches a frame's graphs per backend, so compiling the
        module with it compiles the frames again under the current settings."""
        return functools.partial(DeepCompileBackend.__call__, self)

    def _placeholders(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[fx.Node, int]:
        found: dict[fx.Node, int] = {}
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, example in zip(inputs, example_inputs, strict=False):
            param = self._by_id.get(id(example))
            if param is None:
                grapharg = node.meta.get("grapharg")
                param = self._by_id.get(id(getattr(grapharg, "example", None))) if grapharg is not None else None
            if param is not None:
                found[node] = int(param.ds_id)
        return found

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        number = self.graph_count
        self.graph_count += 1
        count = passes.insert_gathers(gm, self._names, self._placeholders(gm, example_inputs))
        logger.debug("DeepCompile: graph %d has %d partitioned parameters", number, count)

        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
            passes.tag_recompute(joint)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        def compiler(label: str, graph: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
            placed = passes.schedule_gathers(graph, self._names, prefetch=self.prefetch)
            if self.overlap is not None:
                overlap_gathers(graph, ahead=self.overlap, keys=self._keys)
                placed = passes.placed_ops(graph, self._names)
            key = f"{label} {number}"
            self.schedule.graphs[key] = placed
            log = logger.info if self.debug_log else logger.debug
            for line in Schedule({key: placed}).lines():
                log("DeepCompile schedule: %s", line)
            return compile_graph(self.inner, graph, inputs, backward=label == "backward")

        kwargs: dict[str, Any] = {
            "fw_compiler": functools.partial(compiler, "forward"),
            "bw_compiler": functools.partial(compiler, "backward"),
            "partition_fn": partition,
        }
        if self.inner == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            kwargs["decompositions"] = select_decomp_table()
            kwargs["keep_inference_input_mutations"] = True
        return aot_autograd(**kwargs)(gm, example_inputs)


def compile_graph(
    inner: Literal["inductor", "eager"], graph: fx.GraphModule, inputs: Sequence[Any], *, backward: bool
) -> Callable[..., Any]:
    """One partitioned graph (the passes already ran on it) as AOTAutograd's compiled callable: inductor's native
    code, or the FX graph run as Python (`_boxed`)."""
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx_inner

        return compile_fx_inner(graph, inputs, is_backward=backward)
    return _boxed(graph)


def _boxed(gm: fx.GraphModule) -> Callable[..., Any]:
    """`gm` as AOTAutograd's boxed callable that clears its argument list and drops each input after its
    last use (torch.fx's boxed code generation), instead of holding every input until it returns."""
    codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if codegen is None:  # an older torch: inputs live until the graph returns
        from torch._functorch.aot_autograd import make_boxed_func

        return make_boxed_func(gm.forward)
    gm.graph.set_codegen(codegen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
