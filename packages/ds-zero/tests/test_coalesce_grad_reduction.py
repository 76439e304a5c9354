"""`coalesce_grad_reduction()` on the stage 1/2 optimizer in one process: the reduction waits for the block's exit.

Inside the block a stage-2 backward leaves its gradients on the parameters (no reduction into the fp32
partitions yet); the exit reduces the summed gradients, and the step equals plain PyTorch's on the same
backwards. Misuse (a nested block, `step()` inside) is refused; a block that raises reduces nothing.
The multi-rank behaviour (fewer collectives, stage 3) is tested through the engine, in
ds-engine's tests/dist/test_dist_coalesce_grad_reduction.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ds_zero
from ds_comm import UsageError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _zero(model: nn.Module, stage: int) -> ds_zero.DeepSpeedZeroOptimizer:
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return ds_zero.ZeroOptimizer(base, config=ds_zero.ZeroConfig(stage=stage, reduce_bucket_size=20), module=model)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("stage", [1, 2])
def test_block_matches_plain_torch(stage: int) -> None:
    model, ref = _model(), _model()
    opt = _zero(model, stage)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        with opt.coalesce_grad_reduction():
            assert opt.coalescing_grad_reduction
            for chunk in range(3):
                opt.backward(model(_x(10 * step + chunk)).pow(2).mean())
                (ref(_x(10 * step + chunk)).pow(2).mean()).backward()
        assert not opt.coalescing_grad_reduction
        assert opt.step() is True
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(_flat(model), _flat(ref), rtol=0, atol=1e-6, msg=f"step {step}")


def test_stage2_gradients_wait_on_the_parameters_until_the_exit() -> None:
    model = _model()
    opt = _zero(model, 2)
    with opt.coalesce_grad_reduction():
        opt.backward(model(_x(0)).sum())
        opt.backward(model(_x(1)).sum())
        held = [p.grad.clone() for p in model.parameters()]
        assert all(float(g.abs().sum()) == 0 for g in opt.grad_partitions)  # nothing reduced yet
    assert all(p.grad is None for p in model.parameters())  # taken off the parameters by the reduction
    reduced = torch.cat([g.reshape(-1) for g in held])
    torch.testing.assert_close(opt.grad_partitions[0][: reduced.numel()], reduced)


def test_nesting_and_step_inside_are_refused() -> None:
    model = _model()
    opt = _zero(model, 2)
    with opt.coalesce_grad_reduction():
        opt.backward(model(_x(0)).sum())
        with pytest.raises(UsageError, match="already open"), opt.coalesce_grad_reduction():
            pass
        with pytest.raises(AssertionError, match=r"step\(\) inside coalesce_grad_reduction"):
            opt.step()
    assert opt.step() is True


def test_a_block_that_raises_reduces_nothing() -> None:
    model = _model()
    opt = _zero(model, 2)
    with pytest.raises(RuntimeError, match="boom"), opt.coalesce_grad_reduction():
        opt.backward(model(_x(0)).sum())
        raise RuntimeError("boom")
    assert not opt.coalescing_grad_reduction
    assert all(p.grad is not None for p in model.parameters())
    assert all(float(g.abs().sum()) == 0 for g in opt.grad_partitions)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.backward(model(_x(1)).sum())  # reduces during backward again
    assert any(float(g.abs().sum()) > 0 for g in opt.grad_partitions)
