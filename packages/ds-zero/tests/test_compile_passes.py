"""DeepCompile's FX passes on hand-made graphs (no Dynamo, no ranks): where gathers and releases go.

The graph is what the passes see after AOTAutograd: placeholders for two weights and an input, aten ops
with views of the weights (`t`). `insert_gathers` routes every use of a weight through one gather;
`schedule_gathers` must put each gather right before its weight's first reader and its release right after
the last reader of the gathered value or any view of it, and leave a gathered value the graph returns
unreleased. `tag_recompute` marks gathers MUST_RECOMPUTE above every checkpoint region.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ds_zero._compile import passes

aten = torch.ops.aten


def _graph(return_weight: bool = False) -> tuple[fx.GraphModule, dict[fx.Node, int]]:
    g = fx.Graph()
    w1, w2, x = g.placeholder("w1"), g.placeholder("w2"), g.placeholder("x")
    h = g.call_function(aten.relu.default, (x,))
    h = g.call_function(aten.mm.default, (h, g.call_function(aten.t.default, (w1,))))
    h = g.call_function(aten.tanh.default, (h,))
    w2t = g.call_function(aten.t.default, (w2,))
    h = g.call_function(aten.mm.default, (h, w2t))
    h = g.call_function(aten.sigmoid.default, (h,))
    g.output((h, w2) if return_weight else (h,))
    return fx.GraphModule(torch.nn.Module(), g), {w1: 0, w2: 1}


def _order(gm: fx.GraphModule) -> list[str]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            label = {passes.GATHER: "gather", passes.RELEASE: "release"}.get(n.target)
            out.append(f"{label}{n.args[1]}" if label else str(n.target).split(".")[-2])
    return out


def test_gathers_before_first_use_and_releases_after_last_view_use() -> None:
    gm, placeholders = _graph()
    assert passes.insert_gathers(gm, {0: "w1", 1: "w2"}, placeholders) == 2
    placed = passes.schedule_gathers(gm, {0: "w1", 1: "w2"})
    assert _order(gm) == [
        "relu",
        "gather0",
        "t",
        "mm",
        "release0",  # after the mm that reads the view t(w1), not after t itself
        "tanh",
        "gather1",
        "t",
        "mm",
        "release1",
        "sigmoid",
    ]
    assert [(p.kind, p.name, p.anchor) for p in placed] == [
        ("gather", "w1", "t_default"),
        ("release", "w1", "mm_default"),
        ("gather", "w2", "t_default_1"),
        ("release", "w2", "mm_default_1"),
    ]
    assert str(placed[1]).split()[1:4] == ["release", "w1", "(ds_id=0)"]


def test_prefetch_moves_a_gather_earlier() -> None:
    gm, placeholders = _graph()
    passes.insert_gathers(gm, {0: "w1", 1: "w2"}, placeholders)
    passes.schedule_gathers(gm, {0: "w1", 1: "w2"}, prefetch=2)
    order = _order(gm)
    # w2's first reader is the second t: the gather sits two nodes (mm, tanh) before it
    assert order[order.index("gather1") :][:4] == ["gather1", "mm", "release0", "tanh"]
    assert order[order.index("tanh") + 1] == "t"


def test_a_returned_gathered_value_is_not_released() -> None:
    gm, placeholders = _graph(return_weight=True)
    passes.insert_gathers(gm, {0: "w1", 1: "w2"}, placeholders)
    placed = passes.schedule_gathers(gm, {0: "w1", 1: "w2"})
    assert [(p.kind, p.name) for p in placed if p.kind == "release"] == [("release", "w1")]


def test_tag_recompute_marks_gathers_above_checkpoint_regions() -> None:
    gm, placeholders = _graph()
    passes.insert_gathers(gm, {0: "w1", 1: "w2"}, placeholders)
    assert passes.tag_recompute(gm) == 2
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is passes.GATHER:
            assert n.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE
            assert n.meta["ac_graph_id"] > 10**9
