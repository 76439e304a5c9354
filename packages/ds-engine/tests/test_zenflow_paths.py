"""ZenFlow under DeepSpeed's paths: the optimizers, the config model, the core split, and the engine's refusals.

ds runs ZenFlow at ZeRO 1-3 with CPU optimizer offload; `initialize()` must refuse a section it cannot run
before any work (also covered by the table in test_bad_configs.py); a null section is off and fine.
"""

from __future__ import annotations

import sys

import pytest
from ds_engine_testkit import base_config, flat_params, tiny_net

import ds_engine
import ds_ops
from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.runtime.zenflow.zenflow_utils import _split_affinity

NEEDS_CPU_OFFLOAD = r'zero_optimization.zenflow needs zero_optimization.offload_optimizer.device "cpu"'


def test_the_selective_optimizers_are_deepspeed_ops_adam() -> None:
    from ds_engine.ops import adam

    assert adam.ZenFlowSelectiveAdamW is ds_ops.ZenFlowSelectiveAdamW
    assert adam.ZenFlowSelectiveAdamW_stage3 is ds_ops.ZenFlowSelectiveAdamW_stage3
    assert {"ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"} <= set(adam.__all__)


def test_zenflow_config_is_ds_zeros_model() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    from ds_engine.runtime.zenflow.zenflow_config import ZenFlowConfig

    assert ZenFlowConfig is ds_zero.ZenFlowConfig
    assert ds_engine.runtime.zenflow.zenflow_config.ZenFlowConfig is ZenFlowConfig
    assert ds_engine.runtime.zenflow.zenflow_utils._split_affinity is _split_affinity


@pytest.mark.parametrize(
    ("cores", "share", "optimizer", "training"),
    [
        ([4, 5, 6, 7, 8, 9], 1 / 3, [6, 7, 8, 9], [4, 5]),  # exactly 2 of 6
        ([4, 5, 6, 7, 8, 9], 0.34, [7, 8, 9], [4, 5, 6]),  # 2.04 rounds up to 3
        ([3, 1, 2], 0.5, [2], [3, 1]),  # the given order is kept
        ([0, 1, 2], 0.01, [1, 2], [0]),  # any share > 0 keeps one core for training
        ([0, 1, 2], 0.99, [0, 1, 2], [0, 1, 2]),  # rounds to all: both sides share every core
        ([7], 0.5, [7], [7]),
        ([], 0.5, [], []),
    ],
)
def test_split_affinity(cores: list[int], share: float, optimizer: list[int], training: list[int]) -> None:
    assert _split_affinity(cores, share) == (optimizer, training)


def test_split_affinity_refuses_a_share_outside_0_1() -> None:
    with pytest.raises(ValueError, match="pt_reserved_cores_perc must be within \\[0, 1\\], got 1.5"):
        _split_affinity([0, 1], 1.5)


def test_a_null_zenflow_section_is_off() -> None:
    pytest.importorskip("ds_zero")
    cfg = DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 2, "zenflow": None}})
    assert cfg.zero_config.zenflow is None


def test_zenflows_auto_modes_are_values_not_placeholders() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    # the "auto" values reach ZenFlow's own schedule: an epoch's selection, the adaptive update interval
    section = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {"select_strategy": "auto", "update_interval": "auto", "steps_per_epoch": 8},
    }
    cfg = DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": section})
    schedule = ds_zero.ZenFlowSchedule.from_config(cfg.zero_config.zenflow)
    assert (schedule.select_strategy, schedule.select_interval) == ("epoch", 8)
    assert schedule.auto_update and schedule.update_interval == 0 and schedule.loss_divisor == 1


def test_initialize_runs_the_adaptive_update_interval() -> None:
    pytest.importorskip("ds_zero")
    model = tiny_net(0)
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.3}}  # DeepSpeed's
    config = base_config(zero_optimization=zero, optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    engine, *_ = ds_engine.initialize(  # defaults: update_interval "auto", select_strategy "auto"
        model=model, config=config, dist_init_required=False
    )
    assert engine.auto_update and engine.gradient_accumulation_steps() == 1
    from ds_engine.explain import explain

    assert 'update_interval "auto" decides' in explain(DeepSpeedConfig(config))
    zero3 = dict(config, zero_optimization=dict(zero, stage=3))  # explain states ZeRO-3's column rule too
    assert "among the columns whole inside one of DeepSpeed's transposed ZeRO-3" in explain(DeepSpeedConfig(zero3))


def test_initialize_refuses_a_zenflow_it_cannot_run_before_any_work() -> None:
    pytest.importorskip("ds_zero")  # ds-zero's ZenFlow checks name the missing CPU offload
    model = tiny_net(0)
    before = flat_params(model)
    zero = {"stage": 2, "zenflow": {"topk_ratio": 0.2, "update_interval": 2}}  # no CPU optimizer offload
    with pytest.raises(DeepSpeedConfigError, match=NEEDS_CPU_OFFLOAD):
        ds_engine.initialize(model=model, config=base_config(zero_optimization=zero), dist_init_required=False)
    assert flat_params(model).equal(before)


def test_zenflow_is_refused_without_ds_zero_too(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ds_zero", None)  # import ds_zero -> ModuleNotFoundError
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.zenflow needs ds-zero"):
        DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 2, "zenflow": {}}})
