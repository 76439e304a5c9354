"""LinearModuleForZeroStage3 under ZeRO stage 3 (zero.Init, 2 ranks): its weights are partitioned and released
after forward, backward still sees them, and training matches a plain-torch nn.Linear model on the whole batch.

Needs ds-zero (the `ds-engine[all]` session).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO stage 3 through the engine needs ds-zero: pip install 'ds-engine[zero]'")

STEPS, WORLD, MICRO = 4, 2, 3


def _model(linear: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(linear(10, 24), nn.Tanh(), linear(24, 24), nn.Tanh(), linear(24, 3, bias=False))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(STEPS, WORLD, MICRO, 10, generator=g), torch.randn(STEPS, WORLD, MICRO, 3, generator=g)


def _train(rank: int, world: int) -> dict[str, object]:
    import ds_engine as deepspeed
    from ds_engine.runtime.zero.linear import LinearModuleForZeroStage3

    with deepspeed.zero.Init():
        model = _model(LinearModuleForZeroStage3)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # the reference does not clip
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    x, y = _data()
    losses = []
    for step in range(STEPS):
        loss = nn.functional.mse_loss(engine(x[step, rank]), y[step, rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    shards = [(p.ds_tensor.numel(), p.ds_numel, p.ds_status.name) for p in model.parameters()]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "weights": weights, "shards": shards}


def test_zero3_linear_trains_like_nn_linear() -> None:
    reference = _model(nn.Linear)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _data()
    expected_losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        per_rank = [nn.functional.mse_loss(reference(x[step, r]), y[step, r]) for r in range(WORLD)]
        (sum(per_rank) / WORLD).backward()  # data parallel: the mean of the ranks' gradients
        optimizer.step()
        expected_losses.append([loss.item() for loss in per_rank])
    results = run_ranks(WORLD, _train, timeout_s=120)
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(result["losses"]),
            torch.tensor([losses[rank] for losses in expected_losses]),
            rtol=1e-5,
            atol=1e-6,
        )
        for got, want in zip(result["weights"], reference.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank} weights")
        for shard, numel, status in result["shards"]:
            assert shard == -(-numel // WORLD) and status == "NOT_AVAILABLE"
