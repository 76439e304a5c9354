"""`engine._backward_prologue` / `_backward_epilogue`: a script back-propagates one loss through several engines.

Two bf16 engines (stage 0) trained on one summed loss with `loss.backward()` and an epilogue per engine end
bit-identical to each engine trained on its own term with `engine.backward()`: the models share no
parameters, so each gets exactly its term's gradients, and the epilogue moves them into the fp32 buffer as
`backward` would.
"""

from __future__ import annotations

import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

CFG = base_config(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})


def _weights(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def test_shared_loss_with_epilogue_equals_separate_backwards() -> None:
    shared = [make_engine(tiny_net(seed), CFG) for seed in (0, 1)]
    alone = [make_engine(tiny_net(seed), CFG) for seed in (0, 1)]
    for x, y in batches(4, 4, seed=9):
        x, y = x.bfloat16(), y.bfloat16()
        terms = [loss_fn(e(x), y).float() / (i + 1) for i, e in enumerate(shared)]
        sum(terms).backward()
        for engine in shared:
            engine._backward_epilogue()
            assert all(p.grad is None for p in engine.module.parameters())  # moved into fp32
        for engine in shared:
            engine.step()
        for i, engine in enumerate(alone):
            engine.backward(loss_fn(engine(x), y).float() / (i + 1))
            engine.step()
    for mine, reference in zip(shared, alone, strict=True):
        assert torch.equal(_weights(mine), _weights(reference))


def test_prologue_scales_as_backward_does() -> None:
    engine = make_engine(tiny_net(0), base_config(gradient_accumulation_steps=4))
    loss = torch.tensor(2.0, requires_grad=True)
    assert engine._backward_prologue(loss).item() == 0.5
    assert engine._backward_prologue(loss, scale_wrt_gas=False).item() == 2.0
    assert engine.scale(loss).item() == 0.5
    engine._backward_epilogue()  # fp32 stage 0: nothing to move, and no error
