"""ZeRO 1/2 with a model-parallel group (tensor parallelism): the norm of the whole model, one skip decision.

On 4 gloo ranks, model-parallel pairs {0,1} / {2,3} each hold half of a weight W (cut by rows) and a
whole copy of R (replicated); data-parallel groups {0,2} / {1,3} partition the optimizer. Each rank's
loss is its shard's share of the whole model's loss plus the replicated term, so the gradients are the
whole model's. One SGD step (lr 1) with clipping must equal plain torch on the whole model: gradients
averaged over the data-parallel ranks, `clip_grad_norm_` over [W, R] (R counted once). An inf in one
rank's shard skips the step on all four ranks and halves the loss scale on each.
"""

from __future__ import annotations

import pytest
import torch

from ds_comm.testing import run_ranks

CLIP = 0.05


def _losses(w: torch.Tensor, r: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tanh(x @ w.T).sum() * 0.1, torch.sin(x * r).sum()


def _step(rank: int, world: int, stage: int, poison: bool) -> dict[str, object]:
    import torch.distributed as dist
    from torch import nn

    from ds_ops.precision import DynamicLossScaler
    from ds_zero import DeepSpeedZeroOptimizer, ZeroConfig

    mp_rank, dp_rank = rank % 2, rank // 2
    mp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(0)
    w_full, r_full = torch.randn(6, 5), torch.randn(5)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(100 + dp_rank))

    # plain torch on the whole model, gradients averaged over the data-parallel replicas
    w_ref, r_ref = w_full.clone().requires_grad_(True), r_full.clone().requires_grad_(True)
    sum(_losses(w_ref, r_ref, x)).backward()
    for p in (w_ref, r_ref):
        dist.all_reduce(p.grad, group=dp_groups[mp_rank])
        p.grad.div_(2)
    want_norm = float(torch.nn.utils.clip_grad_norm_([w_ref, r_ref], CLIP))

    model = nn.ParameterDict({"w": nn.Parameter(w_full.chunk(2)[mp_rank].clone()), "r": nn.Parameter(r_full)})
    base = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=7, allgather_bucket_size=10, overlap_comm=stage == 2)
    scaler = DynamicLossScaler(init_scale=8.0, delayed_shift=1)
    opt = DeepSpeedZeroOptimizer(
        base,
        config=cfg,
        module=model,
        loss_scaler=scaler,
        clip_grad=CLIP,
        dp_group=dp_groups[mp_rank],
        model_parallel_group=mp_groups[dp_rank],
        model_parallel_params=[model["w"]],
    )
    cut, replicated = _losses(model["w"], model["r"], x)
    if poison and rank == 1:
        cut = cut * 1e39  # overflows fp32: an inf gradient in this rank's shard only
    opt.backward(cut + replicated)
    applied = opt.step()
    return {
        "applied": applied,
        "scale": scaler.cur_scale,
        "norm": opt.global_grad_norm,
        "want_norm": want_norm,
        "w": model["w"].detach().clone(),
        "r": model["r"].detach().clone(),
        "w_want": (w_full - w_ref.grad).chunk(2)[mp_rank],
        "r_want": r_full - r_ref.grad,
        "w_before": w_full.chunk(2)[mp_rank],
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2])
def test_clip_by_the_whole_models_norm(stage: int) -> None:
    for r in run_ranks(4, _step, stage, False, timeout_s=200):
        assert r["applied"] and r["scale"] == 8.0
        assert r["want_norm"] > CLIP  # clipping was active
        assert r["norm"] == pytest.approx(r["want_norm"], rel=1e-5)
        torch.testing.assert_close(r["w"], r["w_want"], rtol=0, atol=1e-6)
        torch.testing.assert_close(r["r"], r["r_want"], rtol=0, atol=1e-6)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2])
def test_an_inf_in_one_shard_skips_every_rank(stage: int) -> None:
    for r in run_ranks(4, _step, stage, True, timeout_s=200):
        assert not r["applied"] and r["scale"] == 4.0
        assert torch.equal(r["w"], r["w_before"])
