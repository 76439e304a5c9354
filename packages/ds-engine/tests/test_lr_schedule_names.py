"""DeepSpeed's lr-schedule string constants and tuning flags: each names a real schedule or parameter here."""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch

from ds_engine import lr_schedules
from ds_engine._optim.schedulers import build_config_scheduler, check_scheduler_params
from ds_engine.runtime import lr_schedules as runtime_lr_schedules

# DeepSpeed 0.19.x's values, written out so a typo on our side fails here.
EXPECTED = {
    "LR_SCHEDULE": "lr_schedule",
    "LR_RANGE_TEST": "LRRangeTest",
    "ONE_CYCLE": "OneCycle",
    "WARMUP_LR": "WarmupLR",
    "WARMUP_DECAY_LR": "WarmupDecayLR",
    "WARMUP_COSINE_LR": "WarmupCosineLR",
    "LR_RANGE_TEST_MIN_LR": "lr_range_test_min_lr",
    "LR_RANGE_TEST_STEP_RATE": "lr_range_test_step_rate",
    "LR_RANGE_TEST_STEP_SIZE": "lr_range_test_step_size",
    "LR_RANGE_TEST_STAIRCASE": "lr_range_test_staircase",
    "EDGE_VALUE": "edge_value",
    "MID_VALUE": "mid_value",
    "CYCLE_FIRST_STEP_SIZE": "cycle_first_step_size",
    "CYCLE_FIRST_STAIR_COUNT": "cycle_first_stair_count",
    "CYCLE_SECOND_STEP_SIZE": "cycle_second_step_size",
    "CYCLE_SECOND_STAIR_COUNT": "cycle_second_stair_count",
    "DECAY_STEP_SIZE": "decay_step_size",
    "CYCLE_MIN_LR": "cycle_min_lr",
    "CYCLE_MAX_LR": "cycle_max_lr",
    "DECAY_LR_RATE": "decay_lr_rate",
    "CYCLE_MIN_MOM": "cycle_min_mom",
    "CYCLE_MAX_MOM": "cycle_max_mom",
    "DECAY_MOM_RATE": "decay_mom_rate",
    "WARMUP_MIN_LR": "warmup_min_lr",
    "WARMUP_MAX_LR": "warmup_max_lr",
    "WARMUP_NUM_STEPS": "warmup_num_steps",
    "WARMUP_TYPE": "warmup_type",
    "WARMUP_LOG_RATE": "log",
    "WARMUP_LINEAR_RATE": "linear",
    "WARMUP_MIN_RATIO": "warmup_min_ratio",
    "COS_MIN_RATIO": "cos_min_ratio",
    "TOTAL_NUM_STEPS": "total_num_steps",
}
SCHEDULE_KEYS = {
    "LRRangeTest": [
        "LR_RANGE_TEST_MIN_LR",
        "LR_RANGE_TEST_STEP_RATE",
        "LR_RANGE_TEST_STEP_SIZE",
        "LR_RANGE_TEST_STAIRCASE",
    ],
    "OneCycle": [
        "CYCLE_FIRST_STEP_SIZE",
        "CYCLE_FIRST_STAIR_COUNT",
        "CYCLE_SECOND_STEP_SIZE",
        "CYCLE_SECOND_STAIR_COUNT",
        "DECAY_STEP_SIZE",
        "CYCLE_MIN_LR",
        "CYCLE_MAX_LR",
        "DECAY_LR_RATE",
        "CYCLE_MIN_MOM",
        "CYCLE_MAX_MOM",
        "DECAY_MOM_RATE",
    ],
    "WarmupLR": ["WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE"],
    "WarmupDecayLR": ["WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE", "TOTAL_NUM_STEPS"],
    "WarmupCosineLR": ["WARMUP_MIN_RATIO", "WARMUP_NUM_STEPS", "COS_MIN_RATIO", "WARMUP_TYPE", "TOTAL_NUM_STEPS"],
}


@pytest.mark.parametrize("module", [lr_schedules, runtime_lr_schedules], ids=["ds_engine", "runtime"])
def test_every_constant_has_deepspeeds_value(module) -> None:
    for name, value in EXPECTED.items():
        assert getattr(module, name) == value, name
        assert name in module.__all__, name
    assert module.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


@pytest.mark.parametrize("kind", sorted(SCHEDULE_KEYS))
def test_parameter_constants_are_the_schedules_keyword_arguments(kind: str) -> None:
    schedule = getattr(
        lr_schedules,
        getattr(
            lr_schedules,
            {
                "LRRangeTest": "LR_RANGE_TEST",
                "OneCycle": "ONE_CYCLE",
                "WarmupLR": "WARMUP_LR",
                "WarmupDecayLR": "WARMUP_DECAY_LR",
                "WarmupCosineLR": "WARMUP_COSINE_LR",
            }[kind],
        ),
    )
    accepted = set(inspect.signature(schedule.__init__).parameters)
    for constant in SCHEDULE_KEYS[kind]:
        assert getattr(lr_schedules, constant) in accepted, (kind, constant)


def test_a_section_written_with_the_constants_builds_and_steps() -> None:
    c = lr_schedules
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    params = {c.WARMUP_MIN_LR: 0.0, c.WARMUP_MAX_LR: 0.1, c.WARMUP_NUM_STEPS: 10, c.WARMUP_TYPE: c.WARMUP_LINEAR_RATE}
    check_scheduler_params(c.WARMUP_LR, params)
    sched = build_config_scheduler(c.WARMUP_LR, params, opt)
    for _ in range(5):
        sched.step()
    # Five steps leave last_batch_iteration at 4: linear warmup gives max_lr * 4 / num_steps.
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 4 / 10)


def test_tuning_flags_default_to_deepspeeds_values() -> None:
    args, unknown = lr_schedules.add_tuning_arguments(argparse.ArgumentParser()).parse_known_args(["--other", "1"])
    assert unknown == ["--other", "1"]
    assert args.lr_schedule is None and args.cycle_momentum is False
    assert (args.lr_range_test_min_lr, args.lr_range_test_step_size) == (0.001, 1000)
    assert args.lr_range_test_staircase is False
    assert (args.cycle_first_step_size, args.cycle_first_stair_count, args.decay_step_size) == (1000, -1, 1000)
    assert (args.cycle_min_lr, args.cycle_max_lr, args.cycle_min_mom, args.cycle_max_mom) == (0.01, 0.1, 0.8, 0.9)
    assert (args.warmup_min_lr, args.warmup_max_lr, args.warmup_num_steps, args.warmup_type) == (0, 0.001, 1000, "log")
    assert (args.warmup_min_ratio, args.cos_min_ratio) == (0.01, 0.01)


@pytest.mark.parametrize("kind", ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR"])
def test_config_from_args_holds_only_that_schedules_keys(kind: str) -> None:
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", kind, "--warmup_max_lr", "0.5", "--cycle_max_lr", "0.7"])
    config, error = lr_schedules.get_config_from_args(args)
    assert error is None and config["type"] == kind
    family = "WarmupLR" if kind.startswith("Warmup") else kind
    assert set(config["params"]) == {getattr(lr_schedules, k) for k in SCHEDULE_KEYS[family]}
    lr, _ = lr_schedules.get_lr_from_config(config)
    assert lr == {"LRRangeTest": 0.001, "OneCycle": 0.7}.get(kind, 0.5)


def test_config_from_args_reports_a_missing_or_unknown_schedule() -> None:
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    assert lr_schedules.get_config_from_args(parser.parse_args([])) == (
        None,
        "--lr_schedule not specified on command line",
    )
    config, error = lr_schedules.get_config_from_args(parser.parse_args(["--lr_schedule", "Cosine"]))
    assert config is None and "Cosine" in error


def test_override_params_copies_only_flags_that_are_set() -> None:
    params = {"cycle_min_lr": 1.0}
    lr_schedules.override_params(argparse.Namespace(cycle_min_lr=None, warmup_num_steps=7), params)
    assert params == {"cycle_min_lr": 1.0, "warmup_num_steps": 7}
