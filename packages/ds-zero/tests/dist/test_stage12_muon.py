"""Muon under ZeRO 1 and 2 (also with the optimizer offloaded) matches DDP + the same Muon optimizer (fp32, 1e-6 over 8
steps) on 2 gloo ranks.

Muon needs whole matrices; the ZeRO partitions of this model cut through them (a 13x7 and a 9x13
matrix over partitions of odd length), so agreement with DDP shows the gathered update is right.
Also: the Muon momentum stays partitioned in the base optimizer's state and survives a checkpoint
(a resumed run equals the straight one bit for bit). Stage 3: test_stage3_muon.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from zero_dist_cases import batch, flat_params, loss_fn, make_model, train_zero, zero_config

import ds_zero
from ds_comm.testing import run_ranks
from ds_ops import MuonWithAuxAdam

TOL = 1e-6
STEPS = 8


def muon_groups(model: nn.Module) -> list[dict[str, Any]]:
    matrices = [model.emb.weight, model.mid.weight]
    others = [model.emb.bias, model.scale, model.head.weight, model.head.bias]
    return [
        {"params": matrices, "use_muon": True, "lr": 0.02, "weight_decay": 0.1},
        {"params": others, "use_muon": False, "lr": 1e-2, "weight_decay": 0.01},
    ]


def _ddp_reference(rank: int, world: int, clip: float) -> torch.Tensor:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = MuonWithAuxAdam(muon_groups(model))
    for step in range(STEPS):
        x, y = batch(step, 0, rank, world)
        loss_fn(ddp, x, y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return flat_params(model)


def _zero_vs_ddp(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    refs = {clip: _ddp_reference(rank, world, clip) for clip in (0.0, 0.05)}
    for name, stage, clip, extra in (
        ("s1", 1, 0.0, {}),
        ("s2-clip", 2, 0.05, {"overlap_comm": False}),
        ("s2-overlap", 2, 0.0, {"overlap_comm": True}),
        # With the optimizer on the host and reduce_scatter on (DeepSpeed's default), which DeepSpeed after
        # 0.19.8 refuses because its offload keeps only partition slices: ds gathers whole matrices there too.
        ("s1-offload", 1, 0.0, {"reduce_scatter": True, "offload_optimizer": {"device": "cpu"}}),
        ("s2-offload-clip", 2, 0.05, {"reduce_scatter": True, "offload_optimizer": {"device": "cpu"}}),
    ):
        model = make_model()
        opt = ds_zero.DeepSpeedZeroOptimizer(
            MuonWithAuxAdam(muon_groups(model)), config=zero_config(stage, **extra), module=model, clip_grad=clip
        )
        train_zero(opt, model, rank, world, range(STEPS), global_loss=False)
        params = flat_params(model)
        momentum = opt.optimizer.state[opt.masters[0]]["momentum_buffer"]
        out[name] = {
            "diff": float((params - refs[clip]).abs().max()),
            "moved": float((params - flat_params(make_model())).abs().max()),
            "momentum_numel": momentum.numel(),
            "partition_numel": opt.flats[0].partition_numel,
            "group_numel": opt.flats[0].numel,
            "offload": opt.offload,
        }
        opt.close()
    return out


def test_muon_zero12_matches_ddp() -> None:
    results = run_ranks(2, _zero_vs_ddp, timeout_s=150)
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            where = f"rank {rank}, case {name}"
            assert r["diff"] <= TOL, f"{where}: params differ from DDP + Muon by {r['diff']}"
            assert r["moved"] > 1e-3, f"{where}: training did not move the parameters"
            # partitioned momentum: half of the (padded) Muon group per rank
            assert r["momentum_numel"] == r["partition_numel"] < r["group_numel"], where
            assert r["offload"] == ("offload" in name), where


def _resume(rank: int, world: int) -> dict[str, float]:
    def build() -> tuple[nn.Module, ds_zero.DeepSpeedZeroOptimizer]:
        model = make_model()
        return model, ds_zero.DeepSpeedZeroOptimizer(
            MuonWithAuxAdam(muon_groups(model)), config=zero_config(2), module=model
        )

    model, opt = build()
    train_zero(opt, model, rank, world, range(STEPS), global_loss=False)
    straight = flat_params(model)
    opt.close()
    model, opt = build()
    train_zero(opt, model, rank, world, range(STEPS // 2), global_loss=False)
    saved: list[Any] = [None] * world
    torch.distributed.all_gather_object(saved, opt.state_dict())
    opt.close()
    model, opt = build()
    opt.load_state_dict(saved)
    momentum = opt.optimizer.state[opt.masters[0]]["momentum_buffer"]
    train_zero(opt, model, rank, world, range(STEPS // 2, STEPS), global_loss=False)
    opt.close()
    return {"diff": float((flat_params(model) - straight).abs().max()), "momentum": float(momentum.abs().max())}


def test_muon_momentum_survives_a_checkpoint() -> None:
    for rank, r in enumerate(run_ranks(2, _resume, timeout_s=150)):
        assert r["momentum"] > 0, f"rank {rank}: the Muon momentum was not restored"
        assert r["diff"] == 0.0, f"rank {rank}: resumed run differs from the straight run by {r['diff']}"


def test_muon_group_with_vector_is_named() -> None:
    model = make_model()
    opt = MuonWithAuxAdam(muon_groups(model))
    opt.param_groups[0]["params"].append(model.scale)  # smuggled in after construction
    with pytest.raises(ValueError, match=r"use_muon=True but holds parameters with fewer than 2 dims \(scale"):
        ds_zero.DeepSpeedZeroOptimizer(opt, config=zero_config(1), module=model)
