"""ZeRO stage 3 through the engine without an optimizer (evaluation), and `save_16bit_model` at stage 3.

One 2-rank run checks: eval outputs equal the unpartitioned model's (1e-6), the parameters stay
partitioned after forward (each rank's `ds_tensor` holds half), `engine.module` is the partitioned
model, backward/step are refused with a clear error, a model built outside `zero.Init` with different
weights per rank is partitioned from rank 0's values, bf16 casts the shards (not the buffers), and the
16-bit save gathers one module at a time and loads into an unpartitioned model with the same outputs.
Needs ds-zero (the `ds-engine[all]` session).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO stage 3 through the engine needs ds-zero: pip install 'ds-engine[zero]'")


class Stack(nn.Module):
    """Nested modules of different sizes and a buffer, so "one module at a time" is measurable."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.mid = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))
        self.out = nn.Linear(32, 5)
        self.register_buffer("shift", torch.linspace(-1, 1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.inp(x)))) + self.shift


CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
MODULE_NUMELS = {"inp": 12 * 32 + 32, "mid.0": 32 * 48 + 48, "mid.2": 48 * 32 + 32, "out": 32 * 5 + 5}


def _inputs() -> torch.Tensor:
    return torch.randn(4, 12, generator=torch.Generator().manual_seed(3))


def _refused(call: Any) -> str:
    try:
        call()
    except RuntimeError as err:
        return str(err)
    return "<not refused>"


def _eval_and_save(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    import ds_engine as deepspeed

    x = _inputs()
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = Stack()
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=copy.deepcopy(CONFIG))
    engine.eval()
    with torch.no_grad():
        out = engine(x)
    loss = engine(x).sum()  # grad mode: the forward works, backward is refused
    shards = {
        n: (p.ds_tensor.numel(), p.ds_numel, p.ds_status.name, tuple(p.shape), p.data.untyped_storage().nbytes())
        for n, p in model.named_parameters()
    }
    offload = engine.parameter_offload
    offload.release_all()
    offload.reset_peak()
    saved = engine.save_16bit_model(out_dir)
    peak = offload.peak_live_numel

    torch.manual_seed(rank)  # different weights per rank: the engine partitions rank 0's
    plain = Stack()
    no_gather = copy.deepcopy(CONFIG)
    no_gather["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    engine_b, *_ = deepspeed.initialize(model=plain, config=no_gather)
    with torch.no_grad():
        out_b = engine_b(x)
    torch.manual_seed(0)
    with deepspeed.zero.Init():  # bf16: the engine casts the shards (buffers keep fp32)
        model_c = Stack()
    engine_c, *_ = deepspeed.initialize(model=model_c, config={**copy.deepcopy(CONFIG), "bf16": {"enabled": True}})
    with torch.no_grad():
        out_c = engine_c(x.bfloat16())
    bf16 = (model_c.inp.weight.dtype, model_c.inp.weight.ds_tensor.dtype, model_c.shift.dtype)
    return {
        "out": out,
        "out_b": out_b,
        "out_c": out_c,
        "bf16": bf16,
        "shards": shards,
        "module_is_model": engine.module is model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "backward": _refused(lambda: engine.backward(loss)),
        "step": _refused(engine.step),
        "saved": saved,
        "peak": peak,
        "saved_b": engine_b.save_16bit_model(out_dir + "_b"),
    }


def test_stage3_eval_without_optimizer_and_16bit_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    reference = Stack()
    reference_bf16 = copy.deepcopy(reference).bfloat16()
    reference_bf16.shift.data = reference.shift.data  # buffers keep their dtype
    with torch.no_grad():
        expected = reference(_inputs())
        expected_bf16 = reference_bf16(_inputs().bfloat16())
    out_dir = tmp_path / "fp16"
    results = run_ranks(2, _eval_and_save, out_dir=str(out_dir), timeout_s=120)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["out"], expected, rtol=0, atol=1e-6, msg=f"rank {rank} Init-built eval output")
        torch.testing.assert_close(r["out_b"], expected, rtol=0, atol=1e-6, msg=f"rank {rank} engine-partitioned")
        torch.testing.assert_close(r["out_c"], expected_bf16, rtol=0, atol=0, msg=f"rank {rank} bf16")
        assert r["bf16"] == (torch.bfloat16, torch.bfloat16, torch.float32)
        assert r["module_is_model"] and r["optimizer"] is None and r["scheduler"] is None
        for name, (shard, numel, status, shape, full_bytes) in r["shards"].items():
            assert shard == math.ceil(numel / 2), name
            assert status == "NOT_AVAILABLE" and full_bytes < numel * 4, (name, status, full_bytes)  # released
            assert shape == tuple(reference.get_parameter(name).shape), name
        for message in (r["backward"], r["step"]):
            assert (
                "needs an optimizer: this engine was built without one, for evaluation only (ZeRO stage 3" in message
            ), message
        assert r["saved"] is True and r["saved_b"] is False
        # One module's parameters at a time, never the whole model.
        assert 0 < r["peak"] <= max(MODULE_NUMELS.values()) < sum(MODULE_NUMELS.values()), r["peak"]
    assert not (tmp_path / "fp16_b").exists()
    state = torch.load(out_dir / "pytorch_model.bin", weights_only=True)
    assert list(state) == list(reference.state_dict())
    fresh = Stack()
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(fresh(_inputs()), expected, rtol=0, atol=1e-6)


def test_stages_1_and_2_without_optimizer_are_refused_before_any_work() -> None:
    from ds_engine_testkit import base_config, make_engine, tiny_net

    from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
    from ds_engine._plan.plan import plan_assembly

    for stage in (1, 2):
        with pytest.raises(
            DeepSpeedConfigError,
            match=rf"zero_optimization.stage={stage} needs an optimizer .*"
            r"use stage 0 \(replicated model\) or stage 3",
        ):
            make_engine(tiny_net(0), base_config(optimizer=None, zero_optimization={"stage": stage}))
    plan = plan_assembly(DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 3}}), device_type="cpu")
    assert "wrapper: ds_zero.DeepSpeedZeRoOffload (ZeRO stage 3 without an optimizer" in "\n".join(plan.lines())
