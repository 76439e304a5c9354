"""bf16 and fp16 training with ZeRO stays within a stated tolerance of the same run in fp32, and an fp16
overflow on one rank skips the step on every rank.

Tolerances (20 AdamW steps, lr 1e-2/5e-3, clipping at 0.05): per-step loss within 2e-2 (bf16) and
5e-3 (fp16) of fp32; parameters within 3e-2 (bf16) and 5e-3 (fp16) of fp32.
"""

from __future__ import annotations

import pytest
import torch
from zero_dist_cases import batch, flat_params, loss_fn, make_model, make_optimizer, train_zero, zero_config

import ds_zero
from ds_comm.testing import run_ranks
from ds_ops.precision import local_overflow

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-fp32comm": torch.bfloat16}


def _precision_runs(rank: int, world: int, stage: int) -> dict[str, tuple]:
    out = {}
    for name, dtype in DTYPES.items():
        model = make_model(dtype=dtype)
        scaler = ds_zero.DynamicLossScaler(init_scale=2.0**10, scale_window=5) if name == "fp16" else None
        config = zero_config(stage, overlap_comm=True, reduce_bucket_size=200, allgather_bucket_size=400)
        comm = torch.float32 if name == "bf16-fp32comm" else None
        opt = ds_zero.DeepSpeedZeroOptimizer(
            make_optimizer(model),
            config=config,
            module=model,
            loss_scaler=scaler,
            clip_grad=0.05,
            communication_dtype=comm,
        )
        losses = train_zero(opt, model, rank, world, range(20), global_loss=False)
        masters = torch.cat([m.detach().float() for m in opt.masters])
        out[name] = (losses, flat_params(model), opt.loss_scale, masters, [p.dtype for p in model.parameters()])
        opt.close()
    return out


def _precision_both_stages(rank: int, world: int) -> dict[int, dict]:
    return {stage: _precision_runs(rank, world, stage) for stage in (1, 2)}


@pytest.fixture(scope="module")
def precision_results() -> dict[int, dict]:
    return run_ranks(2, _precision_both_stages, timeout_s=150)[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_and_fp16_track_fp32(stage: int, precision_results: dict[int, dict]) -> None:
    res = precision_results[stage]
    fp32_losses, fp32_params = res["fp32"][0], res["fp32"][1]
    for name, loss_tol, param_tol in (("bf16", 2e-2, 3e-2), ("fp16", 5e-3, 5e-3), ("bf16-fp32comm", 2e-2, 3e-2)):
        losses, params, _, masters, dtypes = res[name]
        assert all(d == DTYPES[name] for d in dtypes), f"{name}: model params were not kept in {DTYPES[name]}"
        loss_err = max(abs(a - b) for a, b in zip(losses, fp32_losses, strict=True))
        assert loss_err <= loss_tol, f"{name}: losses differ from fp32 by {loss_err}"
        param_err = float((params - fp32_params).abs().max())
        assert param_err <= param_tol, f"{name}: params differ from fp32 by {param_err}"
        # the fp32 masters carry more precision than the 16-bit model copy
        assert masters.dtype == torch.float32
    # fp16: the dynamic scale grew after clean windows of 5 steps
    assert res["fp16"][2] > 2.0**10


def _overflow_both_stages(rank: int, world: int) -> dict[int, dict]:
    return {stage: _overflow_on_one_rank(rank, world, stage) for stage in (1, 2)}


def _overflow_on_one_rank(rank: int, world: int, stage: int) -> dict:
    model = make_model(dtype=torch.float16)
    scaler = ds_zero.DynamicLossScaler(init_scale=2.0**8, delayed_shift=1)
    opt = ds_zero.DeepSpeedZeroOptimizer(
        make_optimizer(model), config=zero_config(stage), module=model, loss_scaler=scaler
    )

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")  # emb.weight[0] lies in rank 0's partition
        return grad

    applied, local_flags, unchanged = [], [], []
    for step in range(3):
        handle = model.emb.weight.register_hook(poison) if (step == 1 and rank == 1) else None
        before = flat_params(model)
        x, y = batch(step, 0, rank, world)
        opt.backward(loss_fn(model, x, y))
        if handle is not None:
            handle.remove()
        if stage == 2:
            local_flags.append(float(local_overflow(opt.grad_partitions)))
        applied.append(opt.step())
        unchanged.append(bool(torch.equal(before, flat_params(model))))
        if step == 1:
            scale_after_overflow = opt.loss_scale
    return {
        "applied": applied,
        "local": local_flags,
        "unchanged": unchanged,
        "scale": scale_after_overflow,
        "params": flat_params(model),
    }


def test_fp16_overflow_on_one_rank_skips_everywhere() -> None:
    by_rank = run_ranks(2, _overflow_both_stages, timeout_s=90)
    for stage in (1, 2):
        r0, r1 = by_rank[0][stage], by_rank[1][stage]
        for r in (r0, r1):
            assert r["applied"] == [True, False, True], f"stage {stage}"
            assert r["unchanged"] == [False, True, False], f"stage {stage}"
            assert r["scale"] == 2.0**7  # halved once (delayed_shift=1)
        if stage == 2:
            # only rank 0 owns the poisoned element: rank 1 skipped because of the cross-rank check
            assert r0["local"][1] == 1.0 and r1["local"][1] == 0.0
        assert torch.equal(r0["params"], r1["params"])
