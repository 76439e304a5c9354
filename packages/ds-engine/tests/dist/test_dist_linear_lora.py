"""`deepspeed.linear` on gloo ranks: base-weight sharding (each rank keeps 1/world, the gather is the whole
weight, the numerics equal an unsharded layer's), the engine leaving the slices alone, and training runs
that match DeepSpeed 0.19.8's recorded losses.

The DeepSpeed numbers come from `tests/data/linear_lora_deepspeed.json`, written by
`tests/data/record_linear_lora_deepspeed.py` running the same `linear_lora_case` under DeepSpeed 0.19.8
on CPU (gloo, fp32, torch's Adam). Tolerance 1e-5 on every step's loss: the same code runs the same fp32
math, so only summation order may differ.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import linear_lora_case as case
import pytest
import torch
import torch.nn.functional as F

import ds_engine
from ds_comm.testing import run_ranks
from ds_engine.linear import LoRAConfig, OptimizedLinear, QuantizationConfig

# the engine runs (and DeepSpeed's recorded ones) train at ZeRO stage 1
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero (ZeRO stage 1)")

REFERENCE = json.loads((Path(__file__).parents[1] / "data" / "linear_lora_deepspeed.json").read_text())
TOL = 1e-5


def _storage_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sharding(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    whole = torch.randn(12, 16)
    x = torch.randn(3, 16)
    out: dict[str, Any] = {}
    for sharding in (1, world):
        layer = OptimizedLinear(
            16,
            12,
            lora_config=LoRAConfig(lora_r=4, lora_alpha=8, base_weight_sharding=sharding, target_mods=[""]),
            dtype=torch.float32,
        )
        layer.load_state_dict({"weight": whole}, strict=False)
        with torch.no_grad():  # the same nonzero adapters on every rank and layer
            layer.lora_weight_1.weight.copy_(torch.linspace(-1, 1, 64).view(4, 16))
            layer.lora_weight_2.weight.copy_(torch.linspace(-0.5, 0.5, 48).view(12, 4))
        y = layer(x)
        y.square().sum().backward()
        out[sharding] = {
            "bytes": _storage_bytes(layer.weight),
            "local": layer.weight.detach().clone(),
            "gathered": layer.full_weight() if sharding > 1 else layer.weight.detach().clone(),
            "y": y.detach(),
            "grad_a": layer.lora_weight_1.weight.grad.clone(),
        }
    quant = QuantizationConfig(group_size=32)
    layer = OptimizedLinear(
        16,
        12,
        lora_config=LoRAConfig(lora_r=4, base_weight_sharding=world, target_mods=[""]),
        quantization_config=quant,
        dtype=torch.bfloat16,
    )
    layer.load_state_dict({"weight": whole.bfloat16()}, strict=False)
    full = layer.full_weight()
    y_ref = F.linear(x.bfloat16(), full)  # the adapters' B is zero: the layer computes x W^T
    out["quant"] = {
        "bytes": _storage_bytes(layer.weight),
        "full": full,
        "y": layer(x.bfloat16()).detach(),
        "y_ref": y_ref,
    }
    return out


def _engine_keeps_slices(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """Through `initialize` (ZeRO 1): each rank's slice survives the init broadcast; offload_ratio applies; a
    checkpoint (which holds rank 0's slice) loads back with each rank's own slice and the saved adapters."""
    model = case.build(ds_engine, sharding=world, init="loaded")
    for layer in (model.q_proj, model.down_proj):
        layer.lora_config.offload_ratio = 0.5
    before = [p.detach().clone() for p in (model.q_proj.weight, model.down_proj.weight)]
    config = {
        "train_batch_size": 2 * world,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = ds_engine.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    after = [p.detach().clone() for p in (engine.module.q_proj.weight, engine.module.down_proj.weight)]
    adapter = engine.module.q_proj.lora_weight_1.weight
    saved_adapter = adapter.detach().clone()
    engine.save_checkpoint(ckpt_dir)
    with torch.no_grad():
        adapter.zero_()
    engine.load_checkpoint(ckpt_dir)
    reloaded = torch.equal(adapter.detach(), saved_adapter) and torch.equal(engine.module.q_proj.weight, after[0])
    return {
        "same": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "attrs": (engine.optimized_linear_lora_enabled, engine.optimized_linear_base_weight_sharding),
        "offload": [engine.module.q_proj.weight.ds_offload, engine.module.down_proj.weight.ds_offload],
        "local": after[0],
        "reloaded": reloaded,
    }


def _quantized_bf16_engine(rank: int, world: int) -> dict[str, Any]:
    """A quantized LoRA layer built in fp32 trains under a bf16 engine (ZeRO 1); its packed weight stays as it was."""
    torch.manual_seed(0)
    config = QuantizationConfig(group_size=64)
    model = torch.nn.Sequential(
        OptimizedLinear(32, 16, lora_config=LoRAConfig(lora_r=4), quantization_config=config, dtype=torch.float32)
    )
    packed = model[0].weight.detach().clone()
    ds_config = {
        "train_batch_size": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
    }
    engine, *_ = ds_engine.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    x, y = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 16)
    losses = []
    for _ in range(3):
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "packed_kept": torch.equal(engine.module[0].weight.detach(), packed)}


def _ranks(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    if world > 1:
        out = {"sharding": _sharding(rank, world), "engine": _engine_keeps_slices(rank, world, ckpt_dir)}
    else:
        out = {"quantized": _quantized_bf16_engine(rank, world)}
    for name, (run_world, sharding, stage, init) in case.RUNS.items():
        if run_world == world:
            out[name] = case.train(ds_engine, rank, world, sharding, stage, init)
    return out


def _assert_matches_deepspeed(name: str, got: dict[str, Any], rank: int) -> None:
    ref = REFERENCE[name][rank]
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= TOL, f"{name} rank {rank} step {step}: ds {a} vs DeepSpeed {b}"
    for key, value in ref["lora_norms"].items():
        assert abs(got["lora_norms"][key] - value) <= TOL, (name, key)
    assert got["base_norms"] == pytest.approx(ref["base_norms"], abs=TOL)


def test_two_ranks_shard_gather_and_train_like_deepspeed(tmp_path: Path) -> None:
    results = run_ranks(2, _ranks, str(tmp_path), timeout_s=240)
    whole_bytes = 12 * 16 * 4
    for rank, r in enumerate(results):
        s = r["sharding"]
        assert s[1]["bytes"] == whole_bytes and s[2]["bytes"] == whole_bytes // 2  # base weight memory per rank
        torch.testing.assert_close(s[2]["gathered"], s[1]["local"], rtol=0, atol=0)  # gathered == whole
        torch.testing.assert_close(
            s[2]["local"], s[1]["local"].reshape(-1)[rank * 96 : (rank + 1) * 96], rtol=0, atol=0
        )
        torch.testing.assert_close(s[2]["y"], s[1]["y"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s[2]["grad_a"], s[1]["grad_a"], rtol=1e-6, atol=1e-6)
        q = s["quant"]
        assert q["bytes"] == 3 * (32 + 4)  # 96 of the 192 values, as 3 groups of 32 bytes + an fp32 scale each
        rel = (q["full"].float() - s[1]["local"]).abs() / s[1]["local"].abs()
        assert rel.max() <= 2**-4 + 2**-8  # E4M3's half ulp, plus the bf16 input's rounding
        torch.testing.assert_close(q["y"], q["y_ref"], rtol=0, atol=0)
        e = r["engine"]
        assert e["same"] and e["attrs"] == (True, True) and e["offload"] == [True, False] and e["reloaded"]
        _assert_matches_deepspeed("w2_shard2_zero1_seeded", r["w2_shard2_zero1_seeded"], rank)
        _assert_matches_deepspeed("w2_shard2_zero1_loaded", r["w2_shard2_zero1_loaded"], rank)
    assert not torch.equal(results[0]["engine"]["local"], results[1]["engine"]["local"])  # slices differ per rank


def test_one_rank_trains_like_deepspeed(tmp_path: Path) -> None:
    (result,) = run_ranks(1, _ranks, str(tmp_path), timeout_s=120)
    q = result["quantized"]
    assert q["packed_kept"] and q["losses"][-1] < q["losses"][0]  # the adapters learn; the base stays packed
    for name in ("w1_seeded", "w1_loaded"):
        _assert_matches_deepspeed(name, result[name], 0)
