"""ZenFlow at ZeRO-3 (`ZenFlowZeroOptimizer_Stage3`, CPU optimizer offload) on 2 gloo ranks and in one process.

1. Against the plain-PyTorch reference of the same math (`zenflow_math.reference_run` with DeepSpeed's
   ZeRO-3 column choice, `zero3_columns`): 8 micro steps, a reselection every 4 and a CPU update every 2
   (so two selections and four deferred updates, one of them at the step before a reselection), with
   and without warm-up, with the small parameters kept whole (persistent) and with every parameter
   partitioned. The model has biases (updated whole by the selective step) and a weight whose column 3
   is cut by DeepSpeed's transposed partition boundary at 2 ranks (never selectable). Tolerance 1e-5.
2. Against ds's own ZeRO-2 ZenFlow on the same model and data: a model whose two weights each fill one
   stage-2 partition exactly, so DeepSpeed's per-partition choice at stage 2 and its per-weight choice at
   stage 3 pick the same columns; the weights must agree to 1e-5.
3. `overlap_step: true` (the CPU update in a worker process, applied one window late) in one process
   (a rank of the test harness is a daemonic process and cannot start the worker): equal to ZeRO-2's
   overlapped run to 1e-5, and within 5e-2 of the synchronous ZeRO-3 run (it is a different schedule:
   measured 2.5e-2 on weights of O(0.3); the gap is printed and must be non-zero).

Also: the selective moments on the host (`zenflow.offload`) give the same weights (1e-6); bf16 shards stay
within 5e-3 of the fp32 run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from zenflow_math import LR, WD, reference_run, whole_columns, zero3_columns

import ds_ops
import ds_zero
from ds_comm.testing import run_ranks
from ds_zero._zenflow.columns import stage3_columns

STEPS, SELECT, UPDATE, RATIO = 8, 4, 2, 0.3


def _model_a() -> nn.Module:
    """fc2.weight is (3, 7): at 2 ranks DeepSpeed's transposed halves are 11 and 10 elements, cutting column 3."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 3))


def _model_b() -> nn.Module:
    """Two bias-free weights of 96 elements: at stage 2 on 2 ranks each is one rank's whole partition."""
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(12, 8, bias=False), nn.Tanh(), nn.Linear(8, 12, bias=False))


def _batch(step: int, rank: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, d_in, generator=g), torch.randn(5, d_out, generator=g)


def _section(warm: int = 0, overlap: bool = False, host_moments: bool = False) -> dict[str, Any]:
    return {
        "offload": host_moments,
        "topk_ratio": RATIO,
        "select_strategy": "step",
        "select_interval": SELECT,
        "update_interval": UPDATE,
        "full_warm_up_rounds": warm,
        "overlap_step": overlap,
    }


def _train(
    stage: int,
    model: nn.Module,
    rank: int,
    *,
    warm: int = 0,
    overlap: bool = False,
    persistence: int | None = None,
    host_moments: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """ZenFlow at `stage` on this rank's batches; the trained weights (gathered)."""
    d_in, d_out = model[0].in_features, model[-1].out_features
    config: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu"},
        "overlap_comm": True,
        "zenflow": _section(warm, overlap, host_moments),
    }
    if persistence is not None:
        config["stage3_param_persistence_threshold"] = persistence
    model = model.to(dtype)
    base = ds_ops.ZenFlowCPUAdam(model.parameters(), lr=LR, weight_decay=WD)
    selective = {"lr": LR, "weight_decay": WD}
    if stage == 3:
        opt: Any = ds_zero.ZenFlowZeroOptimizer_Stage3(model, base, config=config, selective_optimizer_params=selective)
    else:
        opt = ds_zero.ZenFlowZeroOptimizer(
            base, config=ds_zero.ZeroConfig(**config), module=model, selective_optimizer_params=selective
        )
    try:
        for m in range(STEPS):
            x, y = _batch(m, rank, d_in, d_out)
            opt.backward(nn.functional.mse_loss(model(x.to(dtype)).float(), y) / UPDATE)
            if opt.zenflow_schedule.is_update_boundary(m):
                assert opt.step() is True
            opt.zero_grad()
        if stage == 3:
            selected = [sc.selected_columns for cols in opt.shard_columns for sc in cols if sc.is_matrix]
            assert all(len(s) for s in selected)  # columns really were split off
            with ds_zero.GatheredParameters(list(model.parameters())):
                return [p.detach().float().clone() for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()]
    finally:
        opt.close()


def _reference(model: nn.Module, world: int, warm: int) -> list[torch.Tensor]:
    d_in, d_out = model[0].in_features, model[-1].out_features

    def loss_at(net: nn.Module, m: int) -> torch.Tensor:
        losses = [nn.functional.mse_loss(net(x), y) for x, y in (_batch(m, r, d_in, d_out) for r in range(world))]
        return torch.stack(losses).mean() / UPDATE

    choose = zero3_columns(world) if world > 1 else whole_columns
    reference_run(model, loss_at, STEPS, ratio=RATIO, select=SELECT, update=UPDATE, warm=warm, choose=choose)
    return [p.detach().clone() for p in model.parameters()]


def _rank_vs_reference(rank: int, world: int, warm: int, persistence: int | None) -> float:
    ours = _train(3, _model_a(), rank, warm=warm, persistence=persistence)
    ref = _reference(_model_a(), world, warm)
    return max(float((a - b).abs().max()) for a, b in zip(ours, ref, strict=True))


@pytest.mark.parametrize(("warm", "persistence"), [(0, None), (1, 0)])
def test_zero3_matches_plain_torch_reference(warm: int, persistence: int | None) -> None:
    worst = run_ranks(2, _rank_vs_reference, warm, persistence, timeout_s=240)
    print(f"ZeRO-3 ZenFlow vs reference (warm={warm}, persistence={persistence}): max |diff| {max(worst):.2e}")
    assert max(worst) <= 1e-5


def test_the_cut_column_is_never_chosen() -> None:
    """DeepSpeed's ZeRO-3 rule at 2 ranks on a (3, 7) weight: column 3 straddles the halves."""
    g = torch.zeros(3, 7)
    g[:, 3] = 100.0  # by far the largest column, yet not selectable
    g[:, 5] = 1.0
    assert zero3_columns(2)(g, RATIO).tolist() == [5]
    plan = stage3_columns((3, 7), 2, RATIO, "w")
    assert plan.pieces == ((0, 3, 0), (4, 7, 0)) and plan.num_select_total == 1
    assert plan.select_from_sums(g.abs().sum(dim=0)).tolist() == [5]


def _rank_host_moments(rank: int, world: int) -> float:
    on_host = _train(3, _model_a(), rank, host_moments=True)
    on_device = _train(3, _model_a(), rank)
    return max(float((a - b).abs().max()) for a, b in zip(on_host, on_device, strict=True))


def test_selective_moments_on_the_host_change_nothing() -> None:
    """`zenflow.offload: true` keeps the selective AdamW's moments on the host; the rank-local selection sizes
    change at the reselection, so the host moments are remade at the new size."""
    worst = run_ranks(2, _rank_host_moments, timeout_s=240)
    assert max(worst) <= 1e-6


def _rank_bf16(rank: int, world: int) -> float:
    bf16 = _train(3, _model_a(), rank, dtype=torch.bfloat16)
    fp32 = _train(3, _model_a(), rank)
    return max(float((a - b).abs().max()) for a, b in zip(bf16, fp32, strict=True))


def test_bf16_shards_train_close_to_fp32() -> None:
    """16-bit shards (the selective AdamW works in their dtype, the CPU update on fp32 masters): within bf16's
    rounding of the fp32 run (5e-3; measured 1.8e-3 on weights of O(0.3): bf16 keeps 8 bits)."""
    worst = run_ranks(2, _rank_bf16, timeout_s=240)
    print(f"bf16 vs fp32 ZeRO-3 ZenFlow: max |diff| {max(worst):.2e}")
    assert max(worst) <= 5e-3


def _rank_stage3_vs_stage2(rank: int, world: int) -> float:
    z3 = _train(3, _model_b(), rank)
    z2 = _train(2, _model_b(), rank)
    return max(float((a - b).abs().max()) for a, b in zip(z3, z2, strict=True))


def test_zero3_matches_zero2_zenflow() -> None:
    worst = run_ranks(2, _rank_stage3_vs_stage2, timeout_s=240)
    print(f"ZeRO-3 vs ZeRO-2 ZenFlow at 2 ranks: max |diff| {max(worst):.2e}")
    assert max(worst) <= 1e-5


@pytest.mark.timeout(240)
def test_overlap_step_runs_and_stays_close() -> None:
    overlapped = _train(3, _model_b(), 0, overlap=True)
    overlapped_z2 = _train(2, _model_b(), 0, overlap=True)
    synchronous = _train(3, _model_b(), 0)
    same_math = max(float((a - b).abs().max()) for a, b in zip(overlapped, overlapped_z2, strict=True))
    gap = max(float((a - b).abs().max()) for a, b in zip(overlapped, synchronous, strict=True))
    print(f"overlap_step: ZeRO-3 vs ZeRO-2 {same_math:.2e}; vs synchronous ZeRO-3 {gap:.2e}")
    assert same_math <= 1e-5
    assert 0 < gap <= 5e-2
