"""A script's own `loss.backward()` under a loss scale is refused before any gradient exists (DeepSpeed's
"Loss scaling is required"); `engine.backward(loss)` and `engine.scale(loss).backward()` are not.

Without the guard, fp16 with `initial_scale_power: 8` trained 256x slower at every stage, silently: the
gradients were never multiplied by the scale that `step()` divides them by.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

FP16 = {"enabled": True, "initial_scale_power": 8}


def _stages() -> list[int]:
    try:
        import ds_zero  # noqa: F401
    except ImportError:
        return [0]
    return [0, 1, 2, 3]


def _engine(stage: int, **overrides: Any) -> Any:
    overrides.setdefault("fp16", FP16)
    return make_engine(tiny_net(0), base_config(zero_optimization={"stage": stage}, **overrides))


def _weights(engine: Any) -> torch.Tensor:
    if engine.zero_optimization_stage() == 3:
        import ds_zero

        with ds_zero.GatheredParameters(list(engine.module.parameters())):
            return flat_params(engine.module).clone()
    return flat_params(engine.module).clone()


def _forward_loss(engine: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(engine(x.to(next(engine.module.parameters()).dtype)), y)


@pytest.mark.parametrize("stage", _stages())
def test_direct_backward_under_fp16_raises_before_any_gradient_then_training_goes_on(stage: int) -> None:
    (x, y), (x2, y2) = batches(2, 4)
    engine = _engine(stage)
    before = _weights(engine)
    with pytest.raises(RuntimeError, match=r"Loss scaling is required .*loss scale 256.*engine\.backward\(loss\)"):
        _forward_loss(engine, x, y).backward()
    # Stage 1 keeps `.grad` as views of its flat buffer from the start: empty means None or zeros.
    assert all(p.grad is None or not p.grad.any() for p in engine.module.parameters())
    # The failed backward leaves nothing behind: the next steps equal a fresh engine's.
    for a, b in ((x, y), (x2, y2)):
        engine.backward(_forward_loss(engine, a, b))
        engine.step()
    fresh = _engine(stage)
    for a, b in ((x, y), (x2, y2)):
        fresh.backward(_forward_loss(fresh, a, b))
        fresh.step()
    assert not torch.equal(_weights(engine), before)
    torch.testing.assert_close(_weights(engine), _weights(fresh), rtol=0, atol=0)


@pytest.mark.parametrize("stage", _stages())
def test_scaled_loss_backward_is_allowed_and_equals_engine_backward(stage: int) -> None:
    data = batches(4, 4)
    ours, ref = _engine(stage, gradient_accumulation_steps=2), _engine(stage, gradient_accumulation_steps=2)
    for x, y in data:
        ours.scale(_forward_loss(ours, x, y)).backward()
        ours.step()
        ref.backward(_forward_loss(ref, x, y))
        ref.step()
    assert ours.global_steps == 2
    torch.testing.assert_close(_weights(ours), _weights(ref), rtol=0, atol=0)


def test_a_scaled_loss_kept_across_another_forward_still_counts_as_scaled() -> None:
    (x, y), (x2, y2) = batches(2, 4)
    engine = _engine(0, gradient_accumulation_steps=2)
    first = engine.scale(_forward_loss(engine, x, y))
    second = engine.scale(_forward_loss(engine, x2, y2))
    first.backward()
    second.backward()
    engine.step()
    assert engine.global_steps == 0 and engine.micro_steps == 1


def test_outputs_inside_tuples_and_dicts_are_guarded() -> None:
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_net(0)

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            out = self.net(x)
            return {"pair": (out, out.detach()), "n": 3}

    engine = make_engine(TwoHeads(), base_config(fp16=FP16))
    x, y = batches(1, 4)[0]
    out = engine(x.half())
    with pytest.raises(RuntimeError, match="Loss scaling is required"):
        loss_fn(out["pair"][0], y).backward()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": True, "loss_scale": 1.0}}],
    ids=["fp32", "bf16", "fp16-static-scale-1"],
)
def test_without_a_loss_scale_a_direct_backward_is_exact(overrides: dict[str, Any]) -> None:
    """Stage 0 lets a script back-propagate itself where that changes nothing (ds's deliberate difference)."""
    overrides = {"fp16": {"enabled": False}, **overrides}
    (x, y), (x2, y2) = batches(2, 4)
    ours, ref = _engine(0, **overrides), _engine(0, **overrides)
    for a, b in ((x, y), (x2, y2)):
        _forward_loss(ours, a, b).backward()
        ours.step()
        ref.backward(_forward_loss(ref, a, b))
        ref.step()
    torch.testing.assert_close(_weights(ours), _weights(ref), rtol=0, atol=0)
