"""`finish_step` with a model-parallel group: the norm of a model cut across ranks (tensor parallelism).

The whole model is a cut weight W (each model-parallel rank holds half) and a replicated R (every rank
holds it whole). The norm and the clipped gradients must equal one rank holding [W, R], with R counted
once; an inf on one rank's shard skips the step on every rank and halves the loss scale everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

import ds_comm
from ds_comm.testing import run_ranks
from ds_ops.precision import DynamicLossScaler, LossScaler, finish_step

W = torch.linspace(-3.0, 5.0, 24)
R = torch.linspace(2.0, -1.0, 6)
SCALE = 8.0


def _reference(clip: float) -> tuple[float, torch.Tensor, torch.Tensor]:
    w, r = torch.nn.Parameter(torch.zeros(24)), torch.nn.Parameter(torch.zeros(6))
    w.grad, r.grad = W.clone(), R.clone()
    norm = float(torch.nn.utils.clip_grad_norm_([w, r], clip))
    return norm, w.grad, r.grad


def _flat(mp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This model-parallel rank's loss-scaled [W shard | R] and the view of its W shard."""
    flat = torch.cat([W.chunk(2)[mp_rank], R]) * SCALE
    return flat, flat[:12]


def _replicated_layout(rank: int, world: int) -> dict[str, object]:
    """2 ranks, one model-parallel group, every rank's gradient whole after its (absent) dp reduction."""
    mp = ds_comm.new_group([0, 1])
    flat, cut = _flat(rank)
    out = finish_step([flat], scaler=LossScaler(SCALE), clip=1.0, model_parallel_group=mp, model_parallel_grads=[cut])
    # the same with a dynamic scaler and the explicit overflow check (fp16), an inf on rank 1's shard
    bad, bad_cut = _flat(rank)
    if rank == 1:
        bad_cut[3] = math.inf
    scaler = DynamicLossScaler(init_scale=SCALE, delayed_shift=1)
    skipped = finish_step([bad], scaler=scaler, clip=1.0, model_parallel_group=mp, model_parallel_grads=[bad_cut])
    # bf16-like: scale 1, the norm would carry the overflow; a nan on rank 1's shard only
    bf, bf_cut = _flat(rank)
    bf.div_(SCALE)
    if rank == 1:
        bf_cut[0] = math.nan
    bf_out = finish_step([bf], scaler=None, clip=1.0, model_parallel_group=mp, model_parallel_grads=[bf_cut])
    return {"out": out, "flat": flat, "skipped": skipped, "scale": scaler.cur_scale, "bf": bf_out}


def test_norm_and_clip_over_a_model_parallel_group() -> None:
    results = run_ranks(2, _replicated_layout, timeout_s=60)
    norm, w_ref, r_ref = _reference(1.0)
    for rank, r in enumerate(results):
        assert r["out"].applied and r["out"].grad_norm == pytest.approx(norm, rel=1e-6)
        torch.testing.assert_close(r["flat"][:12], w_ref.chunk(2)[rank], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["flat"][12:], r_ref, rtol=1e-6, atol=1e-7)
        assert not r["skipped"].applied and r["scale"] == SCALE / 2
        assert not r["bf"].applied


def _partitioned_layout(rank: int, world: int) -> dict[str, object]:
    """4 ranks: model-parallel groups {0,1}, {2,3}; data-parallel groups {0,2}, {1,3}, each holding half
    of its [W shard | R] buffer (ZeRO), so R straddles the data-parallel partitions."""
    mp_groups = [ds_comm.new_group([0, 1]), ds_comm.new_group([2, 3])]
    dp_groups = [ds_comm.new_group([0, 2]), ds_comm.new_group([1, 3])]
    mp_rank, dp_rank = rank % 2, rank // 2
    flat, _ = _flat(mp_rank)
    part = flat[dp_rank * 9 : (dp_rank + 1) * 9]  # 18 elements, 12 of them the cut shard
    cut = part[:9] if dp_rank == 0 else part[:3]
    out = finish_step(
        [part],
        scaler=LossScaler(SCALE),
        clip=0.5,
        group=dp_groups[mp_rank],
        partitioned=True,
        model_parallel_group=mp_groups[dp_rank],
        model_parallel_grads=[cut],
    )
    return {"out": out, "part": part, "mp_rank": mp_rank, "dp_rank": dp_rank}


def test_norm_over_data_and_model_parallel_partitions() -> None:
    results = run_ranks(4, _partitioned_layout, timeout_s=90)
    norm, w_ref, r_ref = _reference(0.5)
    for r in results:
        assert r["out"].applied and r["out"].grad_norm == pytest.approx(norm, rel=1e-6)
        whole = torch.cat([w_ref.chunk(2)[r["mp_rank"]], r_ref])
        torch.testing.assert_close(r["part"], whole[r["dp_rank"] * 9 : (r["dp_rank"] + 1) * 9], rtol=1e-6, atol=1e-7)


def test_without_a_group_the_cut_views_are_ignored() -> None:
    flat, cut = _flat(0)
    out = finish_step([flat], scaler=LossScaler(SCALE), compute_norm=True, model_parallel_grads=[cut])
    assert out.grad_norm == pytest.approx(float(torch.cat([W.chunk(2)[0], R]).norm()), rel=1e-6)
