"""DeepCompile's FX passes on hand-made graphs (no Dynamo, no ranks): where gathers and releases go.

The graph is what the passes see after AOTAutograd: placeholders for two weights and an input, aten ops
with views of the weights (`t`). `insert_gathers` routes every use of a weight through one gather;
`schedule_gathers` must put each gather right before its weight's first reader and its release right after
the last reader of the gathered value or any view of it, and leave a gathered value the graph returns
unreleased. `tag_recompute` marks gathers MUST_RECOMPUTE above every checkpoint region.
Also the schedule dump of a range of graphs and `with_overlap` (the engine's pass schedules use both).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ds_zero._compile import passes
from ds_zero._compile.backend import DeepCompileBackend, Schedule, _boxed
from ds_zero._compile.overlap import overlap_gathers

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


def _graph3() -> tuple[fx.GraphModule, dict[fx.Node, int]]:
    """Three Linear-like layers: weight i (viewed by `t`) and bias i, read first by one addmm."""
    g = fx.Graph()
    ws = [g.placeholder(f"w{i}") for i in range(3)]
    bs = [g.placeholder(f"b{i}") for i in range(3)]
    h = g.placeholder("x")
    for w, b in zip(ws, bs, strict=True):
        h = g.call_function(aten.addmm.default, (b, h, g.call_function(aten.t.default, (w,))))
        h = g.call_function(aten.relu.default, (h,))
    g.output((h,))
    placeholders = {w: 2 * i for i, w in enumerate(ws)} | {b: 2 * i + 1 for i, b in enumerate(bs)}
    return fx.GraphModule(torch.nn.Module(), g), placeholders


def _overlapped(ahead: int, keys: dict[int, object] | None = None) -> tuple[fx.GraphModule, int, list[str]]:
    gm, placeholders = _graph3()
    names = {i: f"p{i}" for i in range(6)}
    passes.insert_gathers(gm, names, placeholders)
    passes.schedule_gathers(gm, names)
    buckets = overlap_gathers(gm, ahead=ahead, keys=keys)
    order = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is passes.START:
            order.append("start" + "+".join(map(str, n.args[1])))
        elif n.target is passes.WAIT:
            order.append(f"wait{n.args[2]}")
        elif n.target is passes.RELEASE:
            order.append(f"release{n.args[1]}")
        else:
            order.append(str(n.target).split(".")[-2])
    return gm, buckets, order


def test_overlap_buckets_a_layer_and_starts_the_next_one_ahead() -> None:
    gm, buckets, order = _overlapped(ahead=1)
    assert buckets == 3  # each weight + bias pair is one collective (only the view t between them)
    assert not any(n.target is passes.GATHER for n in gm.graph.nodes)
    assert order[:8] == ["start0+1", "wait0", "start2+3", "t", "wait1", "addmm", "release0", "release1"]
    # the third layer's bucket starts right after the second's first wait, before that layer computes
    second = order.index("wait2")
    assert order[second + 1] == "start4+5" and order.index("start4+5") < order.index("wait4")
    assert order.count("start4+5") == 1 and order[-1] == "relu"
    placed = passes.placed_ops(gm, {i: f"p{i}" for i in range(6)})
    assert [p.kind for p in placed].count("prefetch") == 6
    assert [p.kind for p in placed].count("gather") == [p.kind for p in placed].count("release") == 6


def test_overlap_ahead_zero_only_buckets_and_keys_split_buckets() -> None:
    _, buckets, order = _overlapped(ahead=0)
    assert buckets == 3
    for first in (0, 2, 4):  # each start just before its own bucket's first wait
        assert order[order.index(f"start{first}+{first + 1}") + 1] == f"wait{first}"
    # parameters of different process groups / dtypes never share a collective
    _, buckets, order = _overlapped(ahead=1, keys={i: i % 2 for i in range(6)})
    assert buckets == 6 and "start0" in order and "start1" in order


def test_schedule_counts_what_is_gathered_at_once() -> None:
    names = {i: f"p{i}" for i in range(6)}
    gm, _, _ = _overlapped(ahead=1)
    assert Schedule({"g": passes.placed_ops(gm, names)}).max_gathered("g") == 4  # a layer + the next layer
    gm, _, _ = _overlapped(ahead=0)
    assert Schedule({"g": passes.placed_ops(gm, names)}).max_gathered("g") == 2  # one layer at a time


def test_eager_inner_graph_drops_its_inputs_as_it_goes() -> None:
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output((g.call_function(aten.add.Tensor, (g.call_function(aten.relu.default, (a,)), b)),))
    run = _boxed(fx.GraphModule(torch.nn.Module(), g))
    x, y = torch.randn(3), torch.randn(3)
    args = [x.clone(), y]
    (out,) = run(args)
    torch.testing.assert_close(out, torch.relu(x) + y)
    assert args == [] and run._boxed_call  # AOTAutograd's boxed convention: the list is consumed


def test_schedule_lines_take_a_range_of_graph_numbers() -> None:
    gm, _ = _graph()
    placed = passes.placed_ops(gm, {})
    schedule = Schedule({"forward 0": placed, "backward 0": placed, "forward 1": placed, "backward 1": []})
    heads = [line for line in schedule.lines() if not line.startswith(" ")]
    assert heads[0].startswith("forward 0:") and len(heads) == 4
    later = [line for line in schedule.lines(1) if not line.startswith(" ")]
    assert [line.split(":")[0] for line in later] == ["forward 1", "backward 1"]
    assert [line.split(":")[0] for line in schedule.lines(0, 1) if not line.startswith(" ")] == [
        "forward 0",
        "backward 0",
    ]


def test_with_overlap_changes_the_placement_and_gives_a_new_backend() -> None:
    backend = DeepCompileBackend(torch.nn.Linear(2, 2), inner="eager")
    assert backend.overlap == 1
    first, second = backend.with_overlap(None), backend.fresh()
    assert backend.overlap is None and first is not second  # Dynamo compiles the frames again for a new backend
    with pytest.raises(ValueError, match=r"with_overlap\(-1\): must be None or >= 0"):
        backend.with_overlap(-1)
