"""SuperOffload and partial offload through `initialize()`: the engine's loop, fp16 overflow, clipping, `explain`.

The engine tells ZeRO-3 which backward ends the accumulation window, so SuperOffload's in-backward steps
happen in the ordinary `engine.backward(); engine.step()` loop. With fp16 and an initial loss scale of 2^26
the first steps overflow (skipped: the speculative updates are undone) until the scale has come down; with
`gradient_clipping` the rest are clipped or not. The losses equal, bit for bit, those of the same config
without `super_offload` (DeepSpeedCPUAdam; the in-backward step computes what the step would).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ds_engine
from ds_engine.config import DeepSpeedConfigError
from ds_engine.explain import main

# SuperOffload is ZeRO-3's (ds-zero validates its keys and runs it)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero (ZeRO stage 3)")


def _config(**offload: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "fp16": {"enabled": True, "initial_scale_power": 26},
        "zero_optimization": {"stage": 3, "sub_group_size": 20000, "offload_optimizer": {"device": "cpu", **offload}},
    }


def _train(config: dict[str, Any]) -> tuple[list[float], Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(3)])
    engine, *_ = ds_engine.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(8):
        for _ in range(2):
            x = torch.randn(4, 32, generator=g).half()
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses, engine


def test_superoffload_engine_equals_cpu_offload() -> None:
    plain, plain_engine = _train(_config())
    losses, engine = _train(_config(super_offload=True, cpuadam_cores_perc=0.5))
    sup = engine.optimizer._super
    assert plain_engine.skipped_steps > 0 and engine.skipped_steps == plain_engine.skipped_steps
    assert sup.num_speculative > 0 and sup.num_undone > 0
    assert losses == plain


def test_engine_refuses_bad_values_by_key() -> None:
    bad = _config(super_offload=True)
    bad["zero_optimization"]["stage"] = 2
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization.offload_optimizer.super_offload"):
        ds_engine.initialize(model=nn.Linear(4, 4), config=bad)
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization.offload_optimizer.ratio"):
        ds_engine.initialize(model=nn.Linear(4, 4), config=_config(ratio=1.5))


def test_explain_shows_the_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_config(super_offload=True, ratio=0.8, cpuadam_cores_perc=0.9)))
    assert main([str(path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "partial offload (offload_optimizer.ratio=0.8)" in out and "the first int(0.2 * n)" in out
    assert "SuperOffload (offload_optimizer.super_offload)" in out and "(cpuadam_cores_perc=0.9)" in out
    assert "a step clipped to gradient_clipping=1 undoes and redoes them" in out
