"""Overlap ZeRO-3 gathers with computation: each placed gather becomes an asynchronous start and a wait.

Runs after `schedule_gathers` on each partitioned graph (forward and backward), whose gathers sit just
before their parameters' first readers. In graph order the gathers are grouped into buckets: a run of
gathers with only views (`t`, `view`...) and releases between them (a LayerNorm's weight and bias, a
Linear's weight and bias) is one collective. Bucket j's start goes right after the first wait of
bucket j - `ahead` (so with `ahead=1` the next parameters travel while the current ones are in use), or,
for the first `ahead` buckets, just before its own first wait; every gather is replaced, in its place, by
a wait for its parameter, so each parameter is complete just before its first reader and released where
the schedule put its release. The starts stay in the order of the buckets, the same on every rank, so
the ranks' collectives pair up. `ahead=0` keeps the buckets without overlap.

Memory: besides the parameters in use, at most `ahead` buckets are gathered ahead of their use.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping

from torch import fx

from ds_zero._compile.passes import RELEASE, START, WAIT, _is_gather, _is_view

logger = logging.getLogger(__name__)

__all__ = ["overlap_gathers"]


def _fake_val(node: fx.Node) -> None:
    """Give a new node the `meta["val"]` later passes (inductor's) read, from its inputs' fake values."""
    from torch._guards import detect_fake_mode

    vals = [a.meta.get("val") for a in node.all_input_nodes]
    if any(v is None for v in vals):
        return
    mode = detect_fake_mode(vals)
    if mode is None:
        return

    def fake(arg: object) -> object:
        return arg.meta["val"] if isinstance(arg, fx.Node) else arg

    with mode:
        node.meta["val"] = node.target(*fx.node.map_aggregate(node.args, fake))  # type: ignore[operator]


def overlap_gathers(gm: fx.GraphModule, *, ahead: int = 1, keys: Mapping[int, Hashable] | None = None) -> int:
    """Split every gather in `gm` into a start (`ahead` buckets early) and a wait; returns the buckets.

    Args:
        gm: a graph after `schedule_gathers`.
        ahead: how many buckets are started before the current one is waited for (0: none).
        keys: per ds_id, what parameters in one bucket must share (the process group, the dtype);
            adjacent gathers with different keys go to different buckets.
    """
    if ahead < 0:
        raise ValueError(f"overlap_gathers(ahead={ahead}): must be >= 0")
    graph = gm.graph
    keys = keys or {}
    buckets: list[list[fx.Node]] = []
    adjacent = False  # only views and releases since the last gather
    for node in list(graph.nodes):
        if not _is_gather(node):
            adjacent = adjacent and (_is_view(node) or node.target is RELEASE)
            continue
        key = keys.get(int(node.args[1]))
        if adjacent and keys.get(int(buckets[-1][0].args[1])) == key:
            buckets[-1].append(node)
        else:
            buckets.append([node])
        adjacent = True
    first_waits: list[fx.Node] = []
    for j, bucket in enumerate(buckets):
        args = ([g.args[0] for g in bucket], [int(g.args[1]) for g in bucket])
        early = ahead and j >= ahead
        with graph.inserting_after(first_waits[j - ahead]) if early else graph.inserting_before(bucket[0]):
            start = graph.call_function(START, args)
        _fake_val(start)
        for gather in bucket:
            with graph.inserting_before(gather):
                wait = graph.call_function(WAIT, (start, gather.args[0], gather.args[1]))
            # the gather's value, not its inputs' (`eager_input_vals` would not fit the wait's schema)
            wait.meta = {k: v for k, v in gather.meta.items() if k != "eager_input_vals"}
            gather.replace_all_uses_with(wait)
            graph.erase_node(gather)
            if gather is bucket[0]:
                first_waits.append(wait)
    graph.lint()
    gm.recompile()
    logger.debug("DeepCompile: %d gathers in %d buckets, %d ahead", sum(map(len, buckets)), len(buckets), ahead)
    return len(buckets)
