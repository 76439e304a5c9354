"""DeepSpeed's one-key readers of a raw config dict (`runtime.config.get_gradient_clipping` / `get_log_level`),
the `runtime.constants` defaults, and the engine getters that answer from `_config` (`gradient_clipping()`,
`log_level()`), including `log_level` kept as written."""

from __future__ import annotations

import logging
import types

import pytest
from ds_engine_testkit import base_config, make_engine, tiny_net

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError, DeepSpeedEngine
from ds_engine.runtime import constants
from ds_engine.runtime.config import get_gradient_clipping, get_log_level
from ds_engine.utils import set_log_level_from_string
from ds_engine.utils.logging import DS_LOGGERS


def test_defaults_come_from_the_model() -> None:
    model = DeepSpeedConfig({"train_batch_size": 2}, world_size=1).parsed
    assert constants.GRADIENT_CLIPPING_DEFAULT == model.gradient_clipping == 1.0
    assert constants.LOG_LEVEL_DEFAULT is None is model.log_level
    assert (constants.PARAM_DTYPE_DEFAULT, constants.BUFFER_DTYPE_DEFAULT) == (None, None)
    assert constants.TORCH_AUTOCAST_ENABLED_DEFAULT is False


@pytest.mark.parametrize(
    ("given", "expected"), [({}, 1.0), ({"gradient_clipping": 0}, 0.0), ({"gradient_clipping": 2.5}, 2.5)]
)
def test_get_gradient_clipping(given: dict, expected: float) -> None:
    assert get_gradient_clipping(given) == expected


@pytest.mark.parametrize("level", ["DEBUG", "info", "Warning", None])
def test_get_log_level_keeps_the_spelling(level: str | None) -> None:
    assert get_log_level({} if level is None else {"log_level": level}) == level


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"gradient_clipping": -1.0}, r"gradient_clipping: Input should be greater than or equal to 0"),
        ({"log_level": "loud"}, r"log_level: log level 'loud' is not one of debug, info, warning, error, critical"),
        ({"log_level": 10}, r"log_level: Input should be a valid string"),
    ],
)
def test_bad_values_name_the_key(given: dict, message: str) -> None:
    getter = get_gradient_clipping if "gradient_clipping" in given else get_log_level
    with pytest.raises(DeepSpeedConfigError, match=message):
        getter(given)


def test_engine_getters_read_config() -> None:
    stand_in = types.SimpleNamespace(_config=types.SimpleNamespace(gradient_clipping=0.25, log_level="ERROR"))
    assert DeepSpeedEngine.gradient_clipping(stand_in) == 0.25
    assert DeepSpeedEngine.log_level(stand_in) == "ERROR"


def test_initialize_applies_log_level_as_written() -> None:
    saved = {name: logging.getLogger(name).level for name in DS_LOGGERS}
    try:
        set_log_level_from_string("debug")
        engine = make_engine(tiny_net(0), base_config(log_level="CRITICAL", gradient_clipping=0.5))
        assert engine.log_level() == "CRITICAL" and engine.gradient_clipping() == 0.5
        assert logging.getLogger("DeepSpeed").getEffectiveLevel() == logging.CRITICAL
        assert logging.getLogger("ds_engine.anything").getEffectiveLevel() == logging.CRITICAL
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
