"""A DeepSpeed-layout ZeRO-3 checkpoint of a tensor-parallel model (one file per data- and tensor-parallel
rank, each holding its ZeRO partition of that rank's shards) converts to universal form: every parameter
whole again across both dimensions (uneven column cut, row cut, replicated norm), optimizer states alike,
and without tensor parallelism the plain ZeRO-3 flat files as before."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ds_zero.ds_to_universal import convert_to_universal


def _save(folder: Path, shards: dict[str, list[torch.Tensor]], dp: int, info: dict | None) -> None:
    """DeepSpeed's stage-3 files: per tp rank, each parameter padded to dp equal pieces, rank d's pieces in order."""
    folder.mkdir(parents=True, exist_ok=True)
    tp = len(next(iter(shards.values())))
    for t in range(tp):
        shapes = {name: list(per_tp[t].shape) for name, per_tp in shards.items()}
        for d in range(dp):
            pieces = []
            for per_tp in shards.values():
                flat = per_tp[t].reshape(-1)
                per_rank = math.ceil(flat.numel() / dp)
                padded = torch.cat([flat, flat.new_zeros(per_rank * dp - flat.numel())])
                pieces.append(padded[d * per_rank : (d + 1) * per_rank])
            part = torch.cat(pieces)
            optim = {
                "optimizer_state_dict": {
                    "state": {0: {"exp_avg": part * 3, "exp_avg_sq": part * part}},
                    "param_groups": [{"lr": 0.1}],
                },
                "fp32_flat_groups": [part.clone()],
                "zero_stage": 3,
                "partition_count": dp,
            }
            stem = folder / f"zero_pp_rank_{d}_mp_rank_{t:02d}"
            states = {"param_shapes": [shapes], "ds_version": "0.19.8"}
            if info is not None:
                states["universal_checkpoint_info"] = info
            torch.save(states, f"{stem}_model_states.pt")
            torch.save({"optimizer_state_dict": optim, "ds_version": "0.19.8"}, f"{stem}_optim_states.pt")


def test_tensor_parallel_zero3_shards_merge_across_both_dimensions(tmp_path: Path) -> None:
    up, down, norm = torch.randn(7, 3), torch.randn(3, 7), torch.randn(3)
    shards = {
        "up.weight": [up[:4], up[4:]],  # column, uneven
        "down.weight": [down[:, :4], down[:, 4:]],  # row
        "norm.weight": [norm, norm],  # replicated
    }
    info = {
        "universal_checkpoint_version": 0.4,
        "parameter_with_row_parallelism_patterns": [r"^down\.weight$"],
        "tp_replicated_parameter_patterns": [r"^norm\.weight$"],
    }
    _save(tmp_path / "ckpt", shards, dp=3, info=info)
    out = convert_to_universal(tmp_path / "ckpt", tmp_path / "universal", num_merge_workers=1)
    for name, whole, cat_dim in (("up.weight", up, 0), ("down.weight", down, 1), ("norm.weight", norm, None)):
        for state, value in (("fp32", whole), ("exp_avg", whole * 3), ("exp_avg_sq", whole * whole)):
            saved = torch.load(out / "zero" / name / f"{state}.pt", weights_only=False)
            assert saved.get("cat_dim") == cat_dim
            assert torch.equal(saved["param"], value), (name, state)
        assert not (out / "zero" / name / "step.pt").exists()  # ZeRO-3 keeps the steps in optimizer_state.pt
    assert len(list(out.glob("*_model_states.pt"))) == 6


def test_zero3_without_tensor_parallelism_keeps_flat_files_and_tp_without_info_is_refused(tmp_path: Path) -> None:
    weight = torch.randn(5, 2)
    _save(tmp_path / "plain", {"w": [weight]}, dp=2, info=None)
    out = convert_to_universal(tmp_path / "plain", tmp_path / "u1")
    assert torch.equal(torch.load(out / "zero" / "w" / "fp32.pt", weights_only=False), weight.reshape(-1))
    _save(tmp_path / "bare", {"w": [weight[:3], weight[3:]]}, dp=2, info=None)
    with pytest.raises(ValueError, match="nothing says how its parameters are cut"):
        convert_to_universal(tmp_path / "bare", tmp_path / "u2")
