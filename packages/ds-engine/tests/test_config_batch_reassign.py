"""Assigning the batch fields of a `DeepSpeedConfig` and re-deriving the triple with `_configure_train_batch_size()`.

DeepSpeed code sets `config.train_batch_size` / `train_micro_batch_size_per_gpu` /
`gradient_accumulation_steps` (None: not given) and calls `_configure_train_batch_size()`, which fills the
missing ones or fails with an AssertionError. Cases at a data-parallel world size of 2.
"""

from __future__ import annotations

import pytest

from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError


def _config() -> DeepSpeedConfig:
    return DeepSpeedConfig({"train_batch_size": 4}, world_size=2)


@pytest.mark.parametrize(
    ("tbs", "mbs", "gas", "expected"),
    [
        (32, 16, 1, (32, 16, 1)),
        (32, 8, 2, (32, 8, 2)),
        (32, 8, None, (32, 8, 2)),
        (32, None, 2, (32, 8, 2)),
        (None, 8, 2, (32, 8, 2)),
        (None, 16, None, (32, 16, 1)),
        (32, None, None, (32, 16, 1)),
    ],
)
def test_assigned_fields_resolve_with_deepspeeds_rules(tbs, mbs, gas, expected) -> None:
    config = _config()
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = tbs, mbs, gas
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (tbs, mbs)  # as assigned, until...
    config._configure_train_batch_size()
    got = (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps)
    assert got == expected
    assert config.batch is not None
    for key, value in zip(("train_batch_size", "train_micro_batch_size_per_gpu"), (tbs, mbs), strict=True):
        assert (config.batch.sources[key] == "given") == (value is not None), config.batch.sources


@pytest.mark.parametrize(
    ("tbs", "mbs", "gas", "names"),
    [
        (33, 17, 2, "must equal"),
        (32, 18, 1, "must equal"),
        (33, None, 2, "not a whole number"),
        (None, None, 2, "must be set"),
    ],
)
def test_bad_combination_is_a_config_error_and_an_assertion(tbs, mbs, gas, names) -> None:
    config = _config()
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = tbs, mbs, gas
    with pytest.raises(DeepSpeedConfigError, match=names) as info:
        config._configure_train_batch_size()
    assert isinstance(info.value, AssertionError)
    assert config.train_batch_size == tbs  # left as assigned, unresolved


def test_untouched_config_keeps_its_resolved_batch() -> None:
    config = _config()
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        4,
        2,
        1,
    )
    config._configure_train_batch_size()  # nothing assigned: the same triple
    assert config.gradient_accumulation_steps == 1 and config.train_micro_batch_size_per_gpu == 2
