"""`torch.compile` of the engine's module on CUDA: what works today, and what does not yet (xfail, with why).

Compiling the wrapped module in place (`engine.module.compile()`, what DeepSpeed's `engine.compile()`
does) trains like eager at ZeRO stages 0 and 2: losses and weights within rtol 1e-4 (inductor's
fused kernels evaluate the same math in another order; eager vs eager is exact). At stage 3 the
compiled graph meets the partitioned parameters' stand-in storage and fails (seen on CPU with torch
2.13: inductor's size/stride guard on a gathered parameter). `engine.compile()` compiles the wrapped module
in place and sets `engine.is_compiled`, as DeepSpeed's does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_cuda_zero_engine import _config, _model, _tokens, _weights

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"


def _train(stage: int, compiled: bool, steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    import ds_engine

    torch._dynamo.reset()
    engine, *_ = ds_engine.initialize(model=_model(), config=copy.deepcopy(_config(stage)), dist_init_required=False)
    if compiled:
        engine.module.compile()
    tokens, losses = _tokens(steps), []
    for micro in range(steps):
        idx = tokens[micro].to(DEVICE)
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return torch.tensor(losses), _weights(engine)


@pytest.mark.parametrize("stage", [0, 2])
def test_compiled_module_trains_like_eager(stage: int) -> None:
    eager_losses, eager_weights = _train(stage, compiled=False)
    losses, weights = _train(stage, compiled=True)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights, eager_weights, rtol=1e-4, atol=1e-5)


@pytest.mark.xfail(
    reason="ZeRO-3 + torch.compile: the compiled graph sees the partitioned parameters' stand-in "
    "storage (inductor's size/stride guard fails on a gathered parameter)",
    strict=False,
)
def test_compiled_module_under_zero3_trains_like_eager() -> None:
    eager_losses, eager_weights = _train(3, compiled=False)
    losses, weights = _train(3, compiled=True)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights, eager_weights, rtol=1e-4, atol=1e-5)


def test_engine_compile_api_compiles_the_module() -> None:
    import ds_engine

    engine, *_ = ds_engine.initialize(model=_model(), config=_config(0), dist_init_required=False)
    assert engine.is_compiled is False
    engine.compile()  # DeepSpeed: compiles engine.module in place and sets engine.is_compiled
    assert engine.is_compiled is True
    idx = _tokens(1)[0].to(DEVICE)
    loss = engine(idx[:, :-1], idx[:, 1:])
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
