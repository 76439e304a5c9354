"""ZenFlow at ZeRO-3 in one process: what `ZenFlowZeroOptimizer_Stage3` refuses, each naming its key, before any
parameter is partitioned; and the plain stage-3 optimizer pointing at it.
(Numerics: tests/dist/test_dist_zenflow_stage3.py.)
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
        (_config(zenflow=dict(SECTION, update_interval="auto")), 'zenflow.update_interval="auto"'),
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


def test_checkpoints_are_refused_naming_the_key() -> None:
    model = _model()
    opt = ds_zero.ZenFlowZeroOptimizer_Stage3(model, ds_ops.ZenFlowCPUAdam(model.parameters()), config=_config())
    try:
        with pytest.raises(ValueError, match="zero_optimization.zenflow at zero_optimization.stage 3: saving"):
            opt.state_dict()
        with pytest.raises(ValueError, match="loading a checkpoint is not supported"):
            opt.load_state_dict({})
    finally:
        opt.destroy()
