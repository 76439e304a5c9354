"""FX passes that schedule ZeRO-3 gathers and releases inside a captured graph.

`insert_gathers` runs on Dynamo's graph: every use of a partitioned parameter's placeholder is routed
through one `allgather_param`. AOTAutograd then traces the joint forward/backward graph, in which
`tag_recompute` marks each gather for recomputation, so the partitioner re-gathers in the backward
graph instead of saving full parameters as activations. `schedule_gathers` runs on each partitioned
graph (forward and backward): a gather moves to just before its first user (or `prefetch` nodes
earlier), and a `release_param` goes right after the last user of the gathered value or any view of it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
from collections.abc import Callable

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ds_zero._compile import ops

logger = logging.getLogger(__name__)

__all__ = ["ScheduledOp", "insert_gathers", "placed_ops", "schedule_gathers", "tag_recompute"]

_AFTER_EVERY_REGION = 2**62
GATHER = torch.ops.ds_zero.allgather_param.default
RELEASE = torch.ops.ds_zero.release_param.default
START = torch.ops.ds_zero.allgather_start.default
WAIT = torch.ops.ds_zero.allgather_wait.default


@dataclasses.dataclass(frozen=True)
class ScheduledOp:
    """One gather or release the passes placed: its position in the graph and the node it is next to."""

    kind: str  # "gather", "prefetch" (the asynchronous start of a later gather) or "release"
    ds_id: int
    name: str
    position: int
    anchor: str  # the first user (gather) or the last user (release)

    def __str__(self) -> str:
        where = "before" if self.kind == "gather" else "after"
        return f"{self.position:4d} {self.kind:7s} {self.name} (ds_id={self.ds_id}) {where} {self.anchor}"


def _is_gather(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (GATHER, ops.allgather_param)


def insert_gathers(gm: fx.GraphModule, params: dict[int, str], placeholders: dict[fx.Node, int]) -> int:
    """Route each listed placeholder (node -> ds_id) through one gather, placed after the placeholders."""
    graph = gm.graph
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    count = 0
    for node, ds_id in placeholders.items():
        if not node.users:
            continue
        with graph.inserting_after(last_input):
            gathered = graph.call_function(GATHER, (node, ds_id))
        gathered.meta = dict(node.meta)
        node.replace_all_uses_with(gathered, delete_user_cb=functools.partial(operator.is_not, gathered))
        count += 1
        logger.debug("DeepCompile: gather of %s (ds_id=%d) inserted", params.get(ds_id, "?"), ds_id)
    graph.lint()
    gm.recompile()
    return count


def tag_recompute(joint: fx.GraphModule) -> int:
    """Mark every gather in AOTAutograd's joint graph MUST_RECOMPUTE (the backward gathers again)."""
    count = 0
    for node in joint.graph.nodes:
        if _is_gather(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            # above every activation-checkpoint region's id: the partitioner saves a recomputable node whose
            # user sits in a later region, which would keep a gathered parameter alive until the backward
            node.meta["ac_graph_id"] = _AFTER_EVERY_REGION
            count += 1
    return count


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _alias_users(node: fx.Node) -> list[fx.Node]:
    """Every node that reads `node` or a view of it (views of views included)."""
    out: list[fx.Node] = []
    stack = [node]
    while stack:
        for user in stack.pop().users:
            out.append(user)
            if _is_view(user):
                stack.append(user)
    return out


def schedule_gathers(
    gm: fx.GraphModule,
    names: dict[int, str],
    *,
    prefetch: int = 0,
    on_op: Callable[[ScheduledOp], None] | None = None,
) -> list[ScheduledOp]:
    """Move each gather before its first user (`prefetch` nodes earlier) and release after its last use.

    A gathered value that the graph returns (an output) is not released. Returns the placed ops in graph
    order.
    """
    graph = gm.graph
    gathers = [n for n in graph.nodes if _is_gather(n)]
    for gather in gathers:
        users = [u for u in gather.users if u.op != "output"]
        if not users:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(users, key=order.__getitem__)
        target = first
        for _ in range(prefetch):
            prev = target.prev
            if prev.op == "placeholder" or prev is gather or prev.op == "root":
                break
            if any(arg is prev for arg in gather.all_input_nodes):
                break
            target = prev
        target.prepend(gather)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for gather in gathers:
        readers = _alias_users(gather)
        if not readers or any(r.op == "output" for r in readers):
            continue
        last = max(readers, key=order.__getitem__)
        with graph.inserting_after(last):
            release = graph.call_function(RELEASE, (gather, gather.args[1]))
        release.meta["ds_last_use"] = last.name
    graph.lint()
    gm.recompile()
    placed = placed_ops(gm, names)
    for item in placed:
        if on_op is not None:
            on_op(item)
    return placed


def placed_ops(gm: fx.GraphModule, names: dict[int, str]) -> list[ScheduledOp]:
    """The gathers (blocking ones, or the waits of started ones), their starts ("prefetch") and the
    releases in `gm`, in graph order: what the schedule dump lists."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placed: list[ScheduledOp] = []
    for pos, node in enumerate(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if _is_gather(node) or node.target in (WAIT, ops.allgather_wait):
            ds_id = int(node.args[-1])
            readers = [u for u in node.users if u.target not in (RELEASE, ops.release_param)]
            anchor = min(readers, key=order.__getitem__).name if readers else "-"
            placed.append(ScheduledOp("gather", ds_id, names.get(ds_id, "?"), pos, anchor))
        elif node.target in (START, ops.allgather_start):
            for ds_id in node.args[1]:
                placed.append(ScheduledOp("prefetch", int(ds_id), names.get(int(ds_id), "?"), pos, node.prev.name))
        elif node.target in (RELEASE, ops.release_param):
            ds_id = int(node.args[1])
            placed.append(ScheduledOp("release", ds_id, names.get(ds_id, "?"), pos, node.meta.get("ds_last_use", "?")))
    return placed
