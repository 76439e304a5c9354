"""ZenFlow at ZeRO-3 in one process: what `ZenFlowZeroOptimizer_Stage3` refuses, each naming its key, before any
parameter is partitioned; and the plain stage-3 optimizer pointing at it.
(Numerics: tests/dist/test_dist_zenflow_stage3.py; checkpoints: tests/dist/test_dist_zenflow_checkpoint.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ds_ops
import ds_zero

SECTION = {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 4, "update_interval": 2}


def _config(**overrides: Any) -> dict[str, Any]:
    return {"stage": 3, "offload_optimizer": {"device": "cpu"}, "zenflow": dict(SECTION), **overrides}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (_config(offload_optimizer={"device": "none"}), 'offload_optimizer.device "cpu"'),
        (_config(stage=2), "ZenFlowZeroOptimizer_Stage3 handles stage"),
        (_config(offload_optimizer={"device": "cpu", "super_offload": True}), "super_offload=true"),
        (_config(offload_optimizer={"device": "cpu", "ratio": 0.5}), r"offload_optimizer.ratio=0.5"),
        (_config(overlap_comm=False, zenflow=dict(SECTION, offload=True)), "zenflow.offload=true"),
    ],
)
def test_refusals_name_the_key_before_partitioning(config: dict[str, Any], match: str) -> None:
    model = _model()
    base = ds_ops.ZenFlowCPUAdam(model.parameters())
    with pytest.raises(ValueError, match=match):
        ds_zero.ZenFlowZeroOptimizer_Stage3(model, base, config=config)
    assert not any(ds_zero.is_zero_param(p) for p in model.parameters())


def test_a_base_optimizer_without_step_id_is_refused() -> None:
    model = _model()
    with pytest.raises(TypeError, match="ZenFlowCPUAdam"):
        ds_zero.ZenFlowZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters()), config=_config())


def test_the_plain_stage3_optimizer_points_at_the_zenflow_one() -> None:
    model = _model()
    with pytest.raises(ValueError, match="ZenFlowZeroOptimizer_Stage3"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, ds_ops.ZenFlowCPUAdam(model.parameters()), config=_config())


def test_a_plain_zero3_checkpoint_loads_and_zenflow_starts_afresh(caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint without ZenFlow state (plain ZeRO-3): the weights load, a warning says selection restarts."""
    source = _model()
    plain = ds_zero.DeepSpeedZeroOptimizer_Stage3(
        source, ds_ops.ZenFlowCPUAdam(source.parameters()), config={"stage": 3, "offload_optimizer": {"device": "cpu"}}
    )
    saved = plain.state_dict()
    with ds_zero.GatheredParameters(list(source.parameters())):
        want = [p.detach().clone() for p in source.parameters()]
    plain.destroy()
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = ds_zero.ZenFlowZeroOptimizer_Stage3(model, ds_ops.ZenFlowCPUAdam(model.parameters()), config=_config())
    try:
        with caplog.at_level("WARNING", logger="ds_zero._zenflow.stage3"):
            opt.load_state_dict([saved])
        assert "no ZenFlow state" in caplog.text and opt.micro_step == -1
        with ds_zero.GatheredParameters(list(model.parameters())):
            for p, w in zip(model.parameters(), want, strict=True):
                torch.testing.assert_close(p, w, rtol=0, atol=0)
    finally:
        opt.destroy()
