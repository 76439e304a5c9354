"""`engine.scale(loss).backward()` at every ZeRO stage, and the unmanaged-accumulation config refusals.

A script that runs its own backward on `engine.scale(loss)` must end with the same weights as one calling
`engine.backward(loss)`: same loss division, same loss scale, and ZeRO's gradient hooks do the rest
(fp32 equal exactly, as both run the same ops; bf16 equal too). With `managed_gradient_accumulation:
false`, stages 0 and 1 reduce once in `step()`, so `overlap_comm` is refused there (DeepSpeed's rule).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine import DeepSpeedConfigError

ds_zero = pytest.importorskip("ds_zero")


def _weights(engine: Any) -> torch.Tensor:
    params = list(engine.module.parameters())
    with ds_zero.GatheredParameters(params):  # stage 3: the full values; elsewhere a no-op
        return torch.cat([p.detach().float().reshape(-1).clone() for p in params])


def _train(stage: int, *, use_scale: bool, **overrides: Any) -> tuple[torch.Tensor, Any]:
    config = base_config(zero_optimization={"stage": stage}, gradient_accumulation_steps=2, **overrides)
    engine = make_engine(tiny_net(0), config)
    for x, y in batches(4, 4):
        x = x.to(next(engine.module.parameters()).dtype)
        loss = loss_fn(engine(x), y)
        if use_scale:
            engine.scale(loss).backward()
        else:
            engine.backward(loss)
        engine.step()
    return _weights(engine), engine


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_scaled_user_backward_matches_engine_backward(stage: int) -> None:
    ours, engine = _train(stage, use_scale=True)
    ref, _ = _train(stage, use_scale=False)
    assert engine.global_steps == 2
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_scale_divides_by_accumulation_steps_and_multiplies_by_the_loss_scale() -> None:
    config = base_config(
        zero_optimization={"stage": 1},
        gradient_accumulation_steps=4,
        fp16={"enabled": True, "initial_scale_power": 5, "loss_scale_window": 100},
    )
    engine = make_engine(tiny_net(0), config)
    loss = torch.tensor(3.0, requires_grad=True)
    assert engine.scale(loss).item() == pytest.approx(3.0 / 4 * 2**5)


def test_scaled_user_backward_bf16_stage3_matches_engine_backward() -> None:
    ours, _ = _train(3, use_scale=True, bf16={"enabled": True})
    ref, _ = _train(3, use_scale=False, bf16={"enabled": True})
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 1])
def test_unmanaged_accumulation_refuses_overlap_comm_below_stage_2(stage: int) -> None:
    config = base_config(zero_optimization={"stage": stage, "overlap_comm": True}, managed_gradient_accumulation=False)
    with pytest.raises(DeepSpeedConfigError, match=r"overlap_comm only with ZeRO stage 2") as err:
        make_engine(tiny_net(0), config)
    assert isinstance(err.value, AssertionError)  # what DeepSpeed-style callers catch
    assert f"stage {stage} reduces the gradients once" in str(err.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_unmanaged_accumulation_keeps_overlap_comm_from_stage_2(stage: int) -> None:
    config = base_config(zero_optimization={"stage": stage, "overlap_comm": True}, managed_gradient_accumulation=False)
    engine = make_engine(tiny_net(0), config)
    assert not engine.managed_gradient_accumulation() and engine.zero_overlap_comm()
