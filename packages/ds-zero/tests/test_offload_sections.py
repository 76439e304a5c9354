"""`offload_param` / `offload_optimizer`: None unless given (DeepSpeed's contract), and read through `*_or_default`.

Client code written for DeepSpeed tests `zero_config.offload_param is not None`; ds's mechanism reads the
sections through `offload_param_or_default` / `offload_optimizer_or_default`, so an absent section must
behave exactly as `{"device": "none"}` did.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from ds_comm import ConfigDeprecationWarning, ConfigError, validate_section
from ds_zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig


def _zero(data: dict) -> ZeroConfig:
    return validate_section(ZeroConfig, data, path="zero_optimization")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_absent_sections_are_none_and_read_as_device_none(stage: int) -> None:
    z = _zero({"stage": stage})
    assert z.offload_param is None and z.offload_optimizer is None
    assert z.offload_param_or_default == OffloadParamConfig(device="none")
    assert z.offload_optimizer_or_default == OffloadOptimizerConfig(device="none")
    assert (z.offload_param_device, z.offload_optimizer_device) == ("none", "none")


def test_constructed_directly_without_sections_is_none_too() -> None:
    z = ZeroConfig()
    assert (z.offload_param, z.offload_optimizer) == (None, None)


def test_explicit_null_stays_none() -> None:
    z = _zero({"stage": 3, "offload_param": None, "offload_optimizer": None})
    assert (z.offload_param, z.offload_optimizer) == (None, None)
    assert z.offload_optimizer_or_default.ratio == 1.0


def test_empty_section_is_a_section_with_device_none() -> None:
    z = _zero({"stage": 3, "offload_param": {}, "offload_optimizer": {}})
    assert isinstance(z.offload_param, OffloadParamConfig) and z.offload_param.device == "none"
    assert isinstance(z.offload_optimizer, OffloadOptimizerConfig) and z.offload_optimizer.device == "none"
    # a given section is what the accessors return, not a copy of the defaults
    assert z.offload_param_or_default is z.offload_param
    assert z.offload_optimizer_or_default is z.offload_optimizer


@pytest.mark.parametrize(
    ("legacy", "field"), [("cpu_offload_param", "offload_param"), ("cpu_offload", "offload_optimizer")]
)
def test_deprecated_switches_give_a_cpu_section_when_true_and_none_when_false(legacy: str, field: str) -> None:
    with pytest.warns(ConfigDeprecationWarning, match=f"'{legacy}' is deprecated"):
        on = _zero({"stage": 3, legacy: True})
    section = getattr(on, field)
    assert section is not None and section.device == "cpu"
    assert getattr(on, f"{field}_device") == "cpu"
    with pytest.warns(ConfigDeprecationWarning, match=f"'{legacy}' is deprecated"):
        off = _zero({"stage": 3, legacy: False})
    assert getattr(off, field) is None


def test_deprecated_switch_and_its_section_together_are_refused() -> None:
    with pytest.warns(ConfigDeprecationWarning), pytest.raises(ConfigError, match="keep only 'offload_optimizer'"):
        _zero({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}})


def test_given_sections_are_still_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nvme_path"):
        _zero({"stage": 3, "offload_param": {"device": "nvme"}})
    with pytest.raises(ConfigError, match=r"ratio=0.25 .*needs stage 3, but stage is 2"):
        _zero({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.25}})
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_param\.buffer_count"):
        _zero({"stage": 3, "offload_param": {"buffer_count": -1}})
    z = _zero({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": True}})
    assert z.offload_optimizer is not None and z.offload_optimizer.pipeline
    assert z.offload_optimizer_device == "nvme"
    # partial offload is implemented for device "cpu" only
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "ratio": 0.5}
    with pytest.raises(ConfigError, match=r"offload_optimizer\.ratio=0\.5 \(partial offload\) is not supported with"):
        _zero({"stage": 3, "offload_optimizer": nvme})


def test_absent_sections_warn_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for stage in (0, 1, 2, 3):
            _zero({"stage": stage})


def test_stage_warnings_still_name_a_given_section() -> None:
    with pytest.warns(UserWarning, match="offload_param has no effect at stage 1"):
        _zero({"stage": 1, "offload_param": {"device": "cpu"}})
    with pytest.warns(UserWarning, match="offload_optimizer has no effect at stage 0"):
        z = _zero({"stage": 0, "offload_optimizer": {"device": "cpu"}})
    assert z.offload_optimizer is not None and z.offload_optimizer_device == "none"


def test_a_config_with_absent_sections_serialises_and_round_trips() -> None:
    z = _zero({"stage": 3})
    dumped = z.model_dump()
    assert dumped["offload_param"] is None and dumped["offload_optimizer"] is None
    assert json.loads(z.model_dump_json())["offload_optimizer"] is None
    assert "offload_param=None" in repr(z)
    again = ZeroConfig.model_validate(dumped)
    assert again == z and again.offload_param is None
