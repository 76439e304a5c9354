"""DeepCompile at ZeRO 1/2 in one process: `ds_zero::reduce_grad` placed in the backward graph by
`ReduceGradBackend`, handing each gradient to the stage-1/2 reducer in place of its hook.

`place_reductions` on a hand-made backward graph: a reduction right after each listed gradient's node
(after the placeholders for a gradient that is an input), None returned in its place, a clear error when
the outputs do not line up with the forward's inputs. Through Dynamo: the compiled module (as FX code
and through inductor) trains as plain torch does with accumulation and clipping (a second hand-over by
the hooks would double stage 1's gradients), the graph op enters the reducer once per parameter per backward
and stage 2 leaves nothing on `.grad`; at stage 2 a parameter that also gets a gradient outside the graph
is refused by name; `take_back_from_graph` gives the duty back to the hooks.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import ds_comm
import ds_zero
from ds_zero._compile.reduce_backend import ReduceGradBackend, place_reductions
from ds_zero._compile.reduce_ops import reduce_stats

aten = torch.ops.aten


def _backward_graph() -> fx.GraphModule:
    """Gradients of (w, x, b): mm for w, none for x, the tangent itself for b."""
    g = fx.Graph()
    saved, tangent = g.placeholder("saved"), g.placeholder("tangent")
    mm = g.call_function(aten.mm.default, (tangent, saved))
    t = g.call_function(aten.t.default, (mm,))
    g.output((t, None, tangent))
    return fx.GraphModule(nn.Module(), g)


def test_place_reductions_follows_each_gradient_and_returns_none() -> None:
    gm = _backward_graph()
    placed = place_reductions(gm, {0: 7, 1: 8, 2: 9}, {7: "w", 9: "b"}, num_inputs=3)
    nodes = list(gm.graph.nodes)
    names = [n.name for n in nodes]
    assert [(p.name, p.param_index, p.anchor) for p in placed] == [("b", 9, "tangent"), ("w", 7, "t_default")]
    reduce_b, reduce_w = (n for n in nodes if n.target is torch.ops.ds_zero.reduce_grad.default)
    assert names.index(reduce_w.name) == names.index("t_default") + 1  # right after the node producing it
    assert reduce_b.prev.name == "tangent"  # a gradient that is an input: after the placeholders
    assert nodes[-1].args[0] == (None, None, None)
    assert "reduce  w (param_index=7) after t_default" in str(placed[1])


def test_place_reductions_refuses_misaligned_outputs() -> None:
    with pytest.raises(RuntimeError, match="returns 3 gradients for 4 forward inputs"):
        place_reductions(_backward_graph(), {0: 1}, {}, num_inputs=4)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _model() -> Mlp:
    torch.manual_seed(0)
    return Mlp()


def _zero(model: Mlp, stage: int) -> ds_zero.DeepSpeedZeroOptimizer:
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    config = ds_zero.ZeroConfig(stage=stage, reduce_bucket_size=20)
    return ds_zero.ZeroOptimizer(base, config=config, module=model, clip_grad=0.3)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_backward_hands_gradients_to_the_reducer(stage: int, inner: str) -> None:
    torch._dynamo.reset()
    model, ref = _model(), _model()
    opt = _zero(model, stage)
    backend = ReduceGradBackend(model, opt.graph_gradients(), inner=inner)  # type: ignore[arg-type]
    model.compile(backend=backend, fullgraph=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    reduce_stats.reset()
    for step in range(3):
        for micro in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + micro))
            opt.backward(model(x).pow(2).mean() / 2)
            (ref(x).pow(2).mean() / 2).backward()
            if stage == 2:  # the reducer took the gradients; autograd left nothing to add again
                assert all(p.grad is None for p in model.parameters())
        assert opt.step() is True
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        ref_opt.zero_grad()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert reduce_stats.reductions == 4 * 3 * 2
    assert (backend.schedule.lines()[0]) == "backward 0: 4 gradient reductions"
    sink = opt.graph_gradients()
    assert all(sink.owned_by_graph(p) for p in model.parameters())

    # stage 2: a gradient from outside the graph for a parameter the graph reduces is refused by name (stage 1
    # adds it to the same flat-buffer view as autograd does eagerly)
    x = torch.randn(4, 5)
    if stage == 2:
        with pytest.raises(ds_comm.UsageError, match=r"parameter 'a.weight' received a gradient outside"):
            opt.backward(model(x).sum() + model.a.weight.sum())
        opt.zero_grad()

    sink.take_back_from_graph()  # the hooks own every parameter again: plain eager works
    model._compiled_call_impl = None
    opt.backward(model(x).sum() + model.a.weight.sum())
    assert not any(sink.owned_by_graph(p) for p in model.parameters())
    assert opt.step() is True


def test_zenflow_optimizer_has_no_graph_gradients() -> None:
    model = _model()
    opt = _zero(model, 2)
    opt._runs_zenflow = True  # what ZenFlow's subclass declares
    with pytest.raises(ValueError, match="does not combine with zenflow"):
        opt.graph_gradients()
