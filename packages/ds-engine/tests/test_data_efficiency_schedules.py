"""The curriculum and random-LTD schedules step for step against DeepSpeed 0.19.8's, recorded in a fixture.

`fixtures/data_efficiency/record_deepspeed_schedules.py` ran DeepSpeed's schedulers on the configs it
lists and wrote every step's value; ds's replay of the same configs must give the same values exactly
(the same integers, the same final state).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ds_engine._data import keys
from ds_engine._data.curriculum import CurriculumScheduler
from ds_engine._data.ltd_scheduler import RandomLTDScheduler

FIXTURE = json.loads(
    (Path(__file__).parent / "fixtures" / "data_efficiency" / "deepspeed_schedules.json").read_text(encoding="utf-8")
)
#: the recording script's custom schedule functions, by name
CUSTOM_FUNCTIONS = {"plus_three": lambda step: min(4 + 3 * step, 64)}


def test_fixture_is_deepspeed_0_19_8() -> None:
    assert FIXTURE["deepspeed_version"] == "0.19.8"


@pytest.mark.parametrize("name", sorted(FIXTURE["curriculum"]))
def test_curriculum_matches_deepspeed(name: str) -> None:
    case = FIXTURE["curriculum"][name]
    scheduler = CurriculumScheduler(copy.deepcopy(case["config"]))
    if case["custom_function"] is not None:
        scheduler.set_custom_get_difficulty(CUSTOM_FUNCTIONS[case["custom_function"]])
    values = [scheduler.update_difficulty(step) for step in range(FIXTURE["curriculum_steps"])]
    assert values == case["values"]
    assert scheduler.state == case["final_state"]
    assert scheduler.get_current_difficulty() == case["values"][-1]


@pytest.mark.parametrize("name", sorted(FIXTURE["random_ltd"]))
def test_random_ltd_matches_deepspeed(name: str) -> None:
    case = FIXTURE["random_ltd"][name]
    spec = case["spec"]
    scheduler = RandomLTDScheduler(
        {
            "total_layer_num": spec["total_layer_num"],
            "random_ltd_layer_num": spec["random_ltd_layer_num"],
            "random_ltd_schedule": copy.deepcopy(spec["schedule"]),
            "global_batch_size": spec["global_batch_size"],
            "layer_token_lr_schedule": {"enabled": False},
        }
    )
    seq, tokens = [], []
    for step in range(spec["steps"]):
        scheduler.update_seq(step)
        scheduler.update_seq(step)  # a second micro-batch's forward: counted once
        seq.append(scheduler.get_current_seq())
        tokens.append(scheduler.state["consumed_layer_tokens"])
    assert seq == case["seq"]
    assert tokens == case["consumed_layer_tokens"]
    assert scheduler.state_dict() == case["state_dict"]


def test_state_round_trip_continues_the_schedule() -> None:
    """A scheduler restored from `state_dict()` mid-way goes on exactly as the one that kept running."""
    case = FIXTURE["random_ltd"]["gpt_example"]
    config = {
        "total_layer_num": 12,
        "random_ltd_layer_num": 10,
        "random_ltd_schedule": copy.deepcopy(case["spec"]["schedule"]),
        "global_batch_size": 4,
        "layer_token_lr_schedule": {"enabled": False},
    }
    first = RandomLTDScheduler(config)
    for step in range(50):
        first.update_seq(step)
    second = RandomLTDScheduler(config)
    second.load_state_dict(first.state_dict())
    for step in range(50, 60):
        second.update_seq(step)
    assert second.get_current_seq() == case["seq"][59]
    assert second.state["consumed_layer_tokens"] == case["consumed_layer_tokens"][59]

    curriculum = CurriculumScheduler(FIXTURE["curriculum"]["root_sqrt"]["config"])
    for step in range(30):
        curriculum.update_difficulty(step)
    restored = CurriculumScheduler(FIXTURE["curriculum"]["root_sqrt"]["config"])
    restored.load_state_dict(curriculum.state_dict())
    assert restored.update_difficulty(30) == FIXTURE["curriculum"]["root_sqrt"]["values"][30]


def test_constants_are_deepspeeds() -> None:
    assert FIXTURE["constants"] == {name: getattr(keys, name) for name in keys.__all__}


@pytest.mark.parametrize("name", sorted(FIXTURE["config_dicts"]))
def test_data_efficiency_config_dict_matches_deepspeed(name: str) -> None:
    from ds_engine._data.section import get_data_efficiency_config

    case = FIXTURE["config_dicts"][name]
    assert get_data_efficiency_config(copy.deepcopy(case["param_dict"])) == case["output"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"max_difficulty": 3, "schedule_type": "fixed_linear"}, "curriculum schedule.min_difficulty is required"),
        ({"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "linear"}, "schedule_type='linear'"),
        (
            {"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_root", "schedule_config": {}},
            "schedule_config.total_curriculum_step is required",
        ),
        (
            {
                "min_difficulty": 1,
                "max_difficulty": 3,
                "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": 0, "difficulty_step": 8},
            },
            "total_curriculum_step must be a positive number",
        ),
        (
            {
                "min_difficulty": 1,
                "max_difficulty": 3,
                "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [1, 2], "max_step": [3, 4]},
            },
            "exactly one more entry",
        ),
        (
            {
                "min_difficulty": 1,
                "max_difficulty": 3,
                "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 4]},
            },
            "max_step must not decrease",
        ),
    ],
)
def test_bad_curriculum_config_is_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CurriculumScheduler(config)


def test_custom_schedule_without_function_names_the_fix() -> None:
    scheduler = CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        scheduler.update_difficulty(1)
