"""Muon under ZeRO 3 on 2 gloo ranks matches a plain-PyTorch single-process Muon + AdamW (fp32, 1e-5, 8 steps).

The reference is written here from Muon's definition (Nesterov momentum, five quintic Newton–Schulz
steps on the Frobenius-normalised matrix, `sqrt(rows / cols)` for tall matrices), on the whole
global batch, so it shares no code with ds. Stage 3 keeps `ceil(numel / 2)` of every matrix per
rank (the 13x7 and 9x13 matrices split mid-row), so agreement shows the gathered update is right.
Cases: one gather per tile; tiny gather runs and sub-groups (`reduce_bucket_size`, `sub_group_size`)
with clipping and per-head Muon on the 9x13 matrix (3 heads of 3 rows, `muon_num_heads`); and a
checkpoint round trip (the resumed run equals the straight one, momentum included). The model's
frozen layer stays out of the optimizer (partial training).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
from zero_dist_cases import GLOBAL_BATCH, batch, flat_params, loss_fn, make_model

import ds_zero
from ds_comm.testing import run_ranks
from ds_ops import MuonWithAuxAdam

TOL = 1e-5
STEPS = 8
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
ADAM = {"lr": 1e-2, "weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [
        {"params": [model.emb.weight, model.mid.weight], "use_muon": True, **MUON},
        {"params": [model.emb.bias, model.scale, model.head.weight, model.head.bias], "use_muon": False, **ADAM},
    ]


def _orthogonalize(g: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.t() if tall else g
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        s = x @ x.t()
        x = a * x + (b * s + c * s @ s) @ x
    x = x.t() if tall else x
    return x * math.sqrt(g.shape[0] / g.shape[1]) if tall else x


def _reference(clip: float, heads: int | None) -> torch.Tensor:
    """Single process, whole global batch: torch AdamW for the vectors and the head, Muon by hand for the matrices."""
    model = make_model()
    matrices = [model.emb.weight, model.mid.weight]
    adam = torch.optim.AdamW(_groups(model)[1]["params"], **ADAM)
    momenta = [torch.zeros_like(p) for p in matrices]
    for step in range(STEPS):
        x, y = batch(step, 0, 0, 1)
        loss_fn(model, x, y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        with torch.no_grad():
            for p, m in zip(matrices, momenta, strict=True):
                m.lerp_(p.grad, 1 - MUON["momentum"])
                d = p.grad.lerp(m, MUON["momentum"])
                if heads is not None and p is model.mid.weight:
                    u = torch.cat([_orthogonalize(block) for block in d.split(d.shape[0] // heads)])
                else:
                    u = _orthogonalize(d)
                p.mul_(1 - MUON["lr"] * MUON["weight_decay"]).add_(u, alpha=-MUON["lr"])
        adam.step()
        model.zero_grad()
    return flat_params(model)


def _build(config: dict[str, Any], clip: float = 0.0, heads: int | None = None) -> tuple[nn.Module, Any]:
    model = make_model()
    if heads is not None:
        model.mid.weight.muon_num_heads = heads
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model, MuonWithAuxAdam(_groups(model)), config={"stage": 3, **config}, clip_grad=clip
    )
    return model, opt


def _train(model: nn.Module, opt: Any, rank: int, world: int, steps: range) -> None:
    assert GLOBAL_BATCH % world == 0
    for step in steps:
        x, y = batch(step, 0, rank, world)
        opt.backward(loss_fn(model, x, y))
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module) -> torch.Tensor:
    sd = ds_zero.consolidated_16bit_state_dict(model, rank0_only=False)
    return torch.cat([sd[n].float().reshape(-1) for n, _ in model.named_parameters()])


def _cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    start = flat_params(make_model())
    for name, config, clip, heads in (
        ("one-gather", {}, 0.0, None),
        ("runs+tiles+clip+heads", {"reduce_bucket_size": 100, "sub_group_size": 60}, 0.05, 3),
    ):
        model, opt = _build(config, clip, heads)
        _train(model, opt, rank, world, range(STEPS))
        ref = _reference(clip, heads)
        params = _full(model)
        momentum = [opt.optimizer.state[t.master]["momentum_buffer"] for t in opt.partitions[0].tiles]
        out[name] = {
            "diff": float((params - ref).abs().max()),
            "moved": float((ref - start).abs().max()),
            "tiles": len(opt.partitions[0].tiles),
            "momentum_numel": sum(m.numel() for m in momentum),
            "shard_numel": opt.partitions[0].numel,
        }
    # checkpoint round trip: 4 steps, save, 4 more vs. a fresh optimizer loading the save
    model, opt = _build({})
    _train(model, opt, rank, world, range(STEPS))
    straight = _full(model)
    model, opt = _build({})
    _train(model, opt, rank, world, range(STEPS // 2))
    saved: list[Any] = [None] * world
    torch.distributed.all_gather_object(saved, opt.state_dict())
    model, opt = _build({})
    opt.load_state_dict(saved)
    momentum = opt.optimizer.state[opt.partitions[0].tiles[0].master]["momentum_buffer"]
    restored = float(momentum.abs().max())
    _train(model, opt, rank, world, range(STEPS // 2, STEPS))
    out["resume"] = {"diff": float((_full(model) - straight).abs().max()), "momentum": restored}
    return out


def test_muon_zero3_matches_plain_torch_muon() -> None:
    for rank, r in enumerate(run_ranks(2, _cases, timeout_s=180)):
        for name in ("one-gather", "runs+tiles+clip+heads"):
            case, where = r[name], f"rank {rank}, {name}"
            assert case["diff"] <= TOL, f"{where}: params differ from the plain-torch Muon by {case['diff']}"
            assert case["moved"] > 1e-2, f"{where}: the reference did not move"
            # the momentum stays partitioned: this rank's shards only, ceil(91/2) + ceil(117/2)
            assert case["momentum_numel"] == case["shard_numel"] == 46 + 59, where
        assert r["runs+tiles+clip+heads"]["tiles"] == 2, "sub_group_size did not cut the Muon group"
        assert r["resume"]["momentum"] > 0, f"rank {rank}: the Muon momentum was not restored"
        assert r["resume"]["diff"] == 0.0, f"rank {rank}: resumed run differs from the straight run"


def test_muon_zero3_refusals_name_the_cause() -> None:
    model = make_model()
    with pytest.raises(ValueError, match="offload_optimizer.device=nvme"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(
            model,
            MuonWithAuxAdam(_groups(model)),
            config={"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent"}},
        )
    model = make_model()
    model.mid.weight.muon_num_heads = 4  # 9 rows
    with pytest.raises(ValueError, match=r"mid.weight: muon_num_heads=4 does not split the rows of its \(9, 13\)"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, MuonWithAuxAdam(_groups(model)), config={"stage": 3})
