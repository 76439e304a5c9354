"""ZenFlowConfig (`zero_optimization.zenflow`): DeepSpeed's keys, defaults and checks, and the ZeRO optimizers' refusal.

ds parses the section like DeepSpeed but runs no ZenFlow loop, so a ZeRO optimizer handed an enabled
section must refuse it before it partitions anything.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import ds_zero
from ds_comm import ConfigError, validate_section
from ds_zero import ZenFlowConfig, ZeroConfig
from ds_zero._params.partitioned_param import is_zero_param

NOT_IMPLEMENTED = r"zero_optimization.zenflow: this optimizer does not run ZenFlow's loop"


def _zero(data: dict) -> ZeroConfig:
    return validate_section(ZeroConfig, data, path="zero_optimization")


def test_defaults_match_deepspeed() -> None:
    z = ZenFlowConfig()
    assert (z.topk_ratio, z.select_strategy, z.select_interval, z.update_interval) == (0.1, "auto", "auto", "auto")
    assert (z.overlap_step, z.offload, z.auto_ratio, z.full_warm_up_rounds) == (False, False, 0.99, 0)
    assert (z.pt_reserved_cores_perc, z.steps_per_epoch) == (0.5, None)


def test_absent_or_null_is_off_and_a_present_section_is_on() -> None:
    assert _zero({"stage": 2}).zenflow is None
    assert _zero({"stage": 2, "zenflow": None}).zenflow is None
    assert _zero({"stage": 2, "zenflow": {}}).zenflow == ZenFlowConfig()


def test_a_full_section_with_offload() -> None:
    z = _zero(
        {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "zenflow": {
                "topk_ratio": 0.05,
                "select_strategy": "step",
                "select_interval": 16,
                "update_interval": 3,
                "overlap_step": True,
                "offload": True,
                "auto_ratio": 0.9,
                "full_warm_up_rounds": 2,
                "pt_reserved_cores_perc": 0.25,
            },
        }
    )
    assert z.offload_optimizer.device == "cpu"
    zf = z.zenflow
    assert isinstance(zf, ZenFlowConfig)
    assert (zf.topk_ratio, zf.select_strategy, zf.select_interval, zf.update_interval) == (0.05, "step", 16, 3)
    assert (zf.overlap_step, zf.offload, zf.auto_ratio, zf.full_warm_up_rounds) == (True, True, 0.9, 2)
    assert zf.pt_reserved_cores_perc == 0.25


def test_steps_per_epoch_is_accepted_but_not_dumped() -> None:
    z = ZenFlowConfig(steps_per_epoch=100)
    assert z.steps_per_epoch == 100
    assert "steps_per_epoch" not in z.model_dump()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"topk_ratio": 0.0}, r"zero_optimization.zenflow.topk_ratio: Input should be greater than 0"),
        ({"topk_ratio": 1.0}, r"zero_optimization.zenflow.topk_ratio: Input should be less than 1"),
        ({"select_strategy": "iteration"}, r"zero_optimization.zenflow.select_strategy: Input should be 'auto'"),
        ({"select_interval": "often"}, r"zero_optimization.zenflow.select_interval"),
        ({"update_interval": 0}, r'update_interval must be "auto" or a whole number >= 1, got 0'),
        ({"select_interval": -2}, r'select_interval must be "auto" or a whole number >= 1, got -2'),
        ({"auto_ratio": 1.5}, r"zero_optimization.zenflow.auto_ratio: Input should be less than or equal to 1"),
        ({"full_warm_up_rounds": 1.5}, r"zero_optimization.zenflow.full_warm_up_rounds"),
        ({"pt_reserved_cores_perc": -0.1}, r"zero_optimization.zenflow.pt_reserved_cores_perc: Input should be"),
        ({"topk_ration": 0.2}, r"zero_optimization.zenflow.topk_ration: unknown key .*did you mean 'topk_ratio'"),
    ],
)
def test_bad_values_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _zero({"stage": 2, "zenflow": section})


def test_a_section_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ValidationError):
        ZeroConfig(zenflow=123)


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def test_stage_1_2_optimizer_refuses_zenflow() -> None:
    model = _net()
    config = ZeroConfig(stage=2, offload_optimizer={"device": "cpu"}, zenflow={"topk_ratio": 0.2})
    with pytest.raises(ValueError, match=NOT_IMPLEMENTED):
        ds_zero.DeepSpeedZeroOptimizer(torch.optim.AdamW(model.parameters()), config=config)


def test_stage_3_optimizer_refuses_zenflow_before_partitioning() -> None:
    model = _net()
    with pytest.raises(ValueError, match=NOT_IMPLEMENTED):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(
            model, torch.optim.AdamW(model.parameters()), config={"stage": 3, "zenflow": {}}
        )
    assert not any(is_zero_param(p) for p in model.parameters())
