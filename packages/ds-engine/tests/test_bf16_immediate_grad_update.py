"""`bf16.immediate_grad_update` at ZeRO stage 0 with fp32 gradient accumulation (`data_types.grad_accum_dtype`,
DeepSpeed's BF16_Optimizer): each bf16 gradient moves into the fp32 buffer during backward.

The sums are the same as moving them after the backward, so the weights after several accumulated steps
are bit-identical to the default; what changes is that a layer's 16-bit gradient is already freed while
backward still runs through the earlier layers.
"""

from __future__ import annotations

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

STEPS, GAS = 3, 2


def _train(immediate: bool) -> tuple[torch.Tensor, list[bool]]:
    cfg = base_config(
        bf16={"enabled": True, "immediate_grad_update": immediate},
        gradient_accumulation_steps=GAS,
        data_types={"grad_accum_dtype": "fp32"},  # the fp32 buffer the gradients move into
    )
    engine = make_engine(tiny_net(0), cfg)
    seen_freed: list[bool] = []
    module = engine.module
    # runs when l1.weight's gradient is final, after l2's (later layer, earlier in backward)
    module.l1.weight.register_post_accumulate_grad_hook(lambda p: seen_freed.append(module.l2.weight.grad is None))
    for x, y in batches(STEPS * GAS, 4, seed=3):
        engine.backward(loss_fn(engine(x.bfloat16()), y.bfloat16()).float())
        engine.step()
    weights = torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])
    engine.destroy()
    return weights, seen_freed


def test_same_weights_and_gradients_freed_during_backward() -> None:
    default, freed_default = _train(immediate=False)
    immediate, freed_immediate = _train(immediate=True)
    assert torch.equal(default, immediate)
    assert freed_immediate == [True] * STEPS * GAS and freed_default == [False] * STEPS * GAS


def test_plan_names_it_and_destroy_removes_the_hooks() -> None:
    cfg = base_config(bf16={"enabled": True, "immediate_grad_update": True}, data_types={"grad_accum_dtype": "fp32"})
    engine = make_engine(tiny_net(0), cfg)
    assert any("moved in during backward" in line for line in engine._plan.lines())
    engine.destroy()
    x, y = batches(1, 4)[0]
    loss_fn(engine.module(x.bfloat16()), y.bfloat16()).float().backward()
    assert engine.module.l2.weight.grad is not None  # no hook takes it any more


@pytest.mark.parametrize("stage", [1])
def test_zero_stages_accept_it(stage: int) -> None:
    pytest.importorskip("ds_zero")
    cfg = base_config(bf16={"enabled": True, "immediate_grad_update": True}, zero_optimization={"stage": stage})
    engine = make_engine(tiny_net(0), cfg)
    assert not engine._plan.immediate_grad_update  # ZeRO moves gradients itself
