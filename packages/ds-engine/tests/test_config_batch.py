"""The batch triple: DeepSpeed's derivation rules, exact division, and errors that state the numbers."""

from __future__ import annotations

import pytest

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.config._batch import resolve_batch


@pytest.mark.parametrize(
    ("tbs", "mbs", "gas", "ws", "expected"),
    [
        (8, None, None, 1, (8, 8, 1)),
        (None, 4, None, 1, (4, 4, 1)),
        (8, None, 2, 1, (8, 4, 2)),
        (8, 2, None, 1, (8, 2, 4)),
        (None, 2, 3, 1, (6, 2, 3)),
        (32, 4, None, 2, (32, 4, 4)),
        (32, None, 4, 2, (32, 4, 4)),
        (None, 4, 4, 2, (32, 4, 4)),
        (16, None, None, 4, (16, 4, 1)),
        (24, 3, 2, 4, (24, 3, 2)),
    ],
)
def test_any_two_determine_the_third(tbs, mbs, gas, ws, expected) -> None:
    plan = resolve_batch(tbs, mbs, gas, ws)
    assert (plan.train_batch_size, plan.train_micro_batch_size_per_gpu, plan.gradient_accumulation_steps) == expected


def test_sources_say_where_each_number_came_from() -> None:
    plan = resolve_batch(None, 4, 4, 2)
    assert plan.sources == {
        "train_batch_size": "derived: train_micro_batch_size_per_gpu x gradient_accumulation_steps"
        " x world size = 4 x 4 x 2",
        "train_micro_batch_size_per_gpu": "given",
        "gradient_accumulation_steps": "given",
    }
    assert resolve_batch(8, None, None, 1).sources["gradient_accumulation_steps"] == "default"


@pytest.mark.parametrize(
    ("raw", "ws", "message"),
    [
        ({"gradient_accumulation_steps": 2}, 1, r"train_batch_size or train_micro_batch_size_per_gpu must be set"),
        ({}, 1, r"train_batch_size or train_micro_batch_size_per_gpu must be set"),
        (
            {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
            1,
            r"train_batch_size \(7\) must equal train_micro_batch_size_per_gpu \(2\) x "
            r"gradient_accumulation_steps \(3\) x data-parallel world size \(1\) = 6",
        ),
        (
            {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2},
            1,
            r"gradient_accumulation_steps: .*= 7 / 2 = 3.5 is not a whole number",
        ),
        (
            {"train_batch_size": 10, "gradient_accumulation_steps": 4},
            1,
            r"train_micro_batch_size_per_gpu: .*10 / 4 = 2.5 is not a whole number",
        ),
        ({"train_batch_size": 6}, 4, r"train_micro_batch_size_per_gpu: .*6 / 4 = 1.5"),
        (
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
            4,
            r"train_batch_size \(8\) must equal .* world size \(4\) = 16",
        ),
        ({"train_batch_size": 0}, 1, r"train_batch_size: Input should be greater than 0 \(got 0\)"),
        ({"train_micro_batch_size_per_gpu": -1}, 1, r"train_micro_batch_size_per_gpu: Input should be greater than 0"),
        (
            {"train_batch_size": 8, "gradient_accumulation_steps": 0},
            1,
            r"gradient_accumulation_steps: Input should be "
            r"greater than 0",
        ),
        ({"train_batch_size": 2.5}, 1, r"train_batch_size: .*integer"),
        ({"train_batch_size": True}, 1, r"train_batch_size: expected an integer, got the boolean True"),
    ],
)
def test_bad_triples_state_the_numbers(raw, ws, message) -> None:
    with pytest.raises(DeepSpeedConfigError, match=message):
        DeepSpeedConfig(raw, world_size=ws)
