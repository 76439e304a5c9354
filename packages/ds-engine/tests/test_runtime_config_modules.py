"""`deepspeed.runtime.{precision_config, config_utils, config, zero.config}`: DeepSpeed's names over ds's models."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import pytest
from pydantic import Field, ValidationError

import ds_comm
from ds_engine.config import BF16Config, DeepSpeedConfig, FP16Config


def test_precision_config_models_are_the_engines_sections() -> None:
    from ds_engine.runtime import precision_config as pc

    assert pc.DeepSpeedFP16Config is FP16Config and pc.DeepSpeedBF16Config is BF16Config
    assert pc.get_bfloat16_config({"bf16": {"enabled": True}}).enabled
    assert pc.get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled  # the legacy name
    assert not pc.get_bfloat16_config({}).enabled
    fp16 = pc.get_float16_config({"fp16": {"enabled": True, "loss_scale": 128}})
    assert fp16.enabled and fp16.loss_scale == 128.0 and not fp16.dynamic_loss_scale
    with pytest.raises(ds_comm.ConfigError, match="fp16.loss_scale"):
        pc.get_float16_config({"fp16": {"loss_scale": -1}})
    with pytest.raises(ds_comm.ConfigError, match="bf16.enabeld"):
        pc.get_bfloat16_config({"bf16": {"enabeld": True}})


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale", "hysteresis"])
@pytest.mark.parametrize("value", [0, -1])
def test_fp16_dynamic_knobs_are_checked_only_where_they_are_used(key: str, value: int) -> None:
    with pytest.raises(ValidationError, match=f"{key}={value}.* must be > 0 with dynamic loss scaling"):
        FP16Config(enabled=True, loss_scale=0, **{key: value})
    assert getattr(FP16Config(enabled=True, loss_scale=64, **{key: value}), key) == value  # static: unused
    assert getattr(FP16Config(enabled=False, **{key: value}), key) == value  # fp16 off: unused
    # the same judgement through a whole ds_config
    with pytest.raises(ds_comm.ConfigError, match=f"fp16: {key}"):
        DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True, key: value}})
    DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": False, key: value}})


@pytest.mark.parametrize("value", [True, math.inf, math.nan, "abc", None, [], {}])
def test_fp16_numbers_refuse_bools_non_finite_and_non_numbers(value: Any) -> None:
    for key in ("loss_scale_window", "min_loss_scale", "loss_scale"):
        with pytest.raises(ValidationError):
            FP16Config(enabled=True, **{key: value})
    if isinstance(value, (list, dict)):
        with pytest.raises(ValidationError, match="must be a number"):
            FP16Config(loss_scale=value)


def test_fp16_loss_scale_accepts_numbers_and_numeric_strings() -> None:
    assert [FP16Config(loss_scale=v).loss_scale for v in (0, 1, 2.5, "3")] == [0.0, 1.0, 2.5, 3.0]


def _model() -> Any:
    from ds_engine.runtime.config_utils import DeepSpeedConfigModel

    class Sub(DeepSpeedConfigModel):
        depth: int = 0

    class Conf(DeepSpeedConfigModel):
        size: int = 0
        names_old: str | None = Field(
            None, json_schema_extra={"deprecated": True, "new_param": "names", "new_param_fn": lambda x: [x]}
        )
        names: list[str] | None = None
        level_old: int | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "sub.depth"})
        sub: Sub = Sub()
        quiet_old: int | None = Field(None, json_schema_extra={"deprecated": True, "deprecated_msg": "no effect"})
        width: int = Field(0, alias="width_alias")

    return Conf


def test_config_model_maps_deprecated_fields_and_warns() -> None:
    conf = _model()
    with pytest.warns(ds_comm.ConfigDeprecationWarning, match="'names_old' is deprecated; use 'names'"):
        c = conf(names_old="a")
    assert c.names == ["a"]
    with pytest.warns(ds_comm.ConfigDeprecationWarning, match="'level_old'.*'sub.depth'"):
        nested = conf(level_old=4)
    assert nested.sub.depth == 4
    with pytest.warns(ds_comm.ConfigDeprecationWarning, match="quiet_old' is deprecated. no effect"):
        conf(quiet_old=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert conf(size=3, width_alias=5).width == 5 and conf(width=6).width == 6  # no warning, aliases both ways


def test_config_model_refuses_both_names_drops_auto_and_validates() -> None:
    from ds_engine.runtime.config_utils import DeprecatedAndNewKeyError

    conf = _model()
    with pytest.warns(ds_comm.ConfigDeprecationWarning), pytest.raises(AssertionError, match="both set"):
        conf(names=["b"], names_old="a")
    assert issubclass(DeprecatedAndNewKeyError, ds_comm.ConfigError)
    assert conf(size="auto").size == 0  # "auto" falls back to the default
    with pytest.raises(ValidationError):
        conf(strict=True, size="auto")
    with pytest.raises(ValidationError, match="did you mean 'size'"):
        conf(sise=1)
    c = conf()
    c.size = 7  # mutable, validated
    with pytest.raises(ValidationError):
        c.size = "x"  # type: ignore[assignment]


def test_config_utils_readers() -> None:
    from ds_engine.runtime.config_utils import dict_raise_error_on_duplicate_keys, get_scalar_param

    assert get_scalar_param({"a": 1}, "a", 0) == 1 and get_scalar_param({}, "a", 9) == 9
    assert json.loads('{"a": 1, "b": 2}', object_pairs_hook=dict_raise_error_on_duplicate_keys) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match=r"duplicate keys in the config: \['a'\]"):
        json.loads('{"a": 1, "b": 2, "a": 3}', object_pairs_hook=dict_raise_error_on_duplicate_keys)


def test_runtime_config_optimizer_names_are_what_the_engine_builds() -> None:
    from ds_engine._optim.optimizers import DS_OPTIMIZERS
    from ds_engine.runtime import config

    assert config.ADAM_OPTIMIZER == "adam" and config.ADAMW_OPTIMIZER == "adamw" and config.LION_OPTIMIZER == "lion"
    names = [config.ADAGRAD_OPTIMIZER, config.LAMB_OPTIMIZER, config.MUON_OPTIMIZER]
    assert set(names) <= set(config.DEEPSPEED_OPTIMIZERS) == set(DS_OPTIMIZERS)
    adam_keys = (config.TORCH_ADAM_PARAM, config.ADAM_W_MODE, config.ADAM_W_MODE_DEFAULT)
    assert adam_keys == ("torch_adam", "adam_w_mode", True)


def test_zero_config_names() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    from ds_engine.runtime.zero import config  # this package's module, even before anything imported it

    assert config.__name__ == "ds_engine.runtime.zero.config"
    assert config.DeepSpeedZeroConfig is ds_zero.ZeroConfig
    zc = config.DeepSpeedZeroConfig(stage=config.ZeroStageEnum.gradients, offload_param={}, offload_optimizer={})
    assert zc.stage == 2 == config.ZeroStageEnum.gradients and config.ZeroStageEnum.max_stage == 3
    assert isinstance(zc.offload_param, config.DeepSpeedZeroOffloadParamConfig)
    assert isinstance(zc.offload_optimizer, config.DeepSpeedZeroOffloadOptimizerConfig)


def test_leaf_module_config_defaults_are_the_models() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    from ds_engine.runtime.zero import leaf_module_config as lmc

    assert lmc.DeepSpeedZeroLeafModuleConfig is ds_zero.config.LeafModuleConfig
    zc = ds_zero.ZeroConfig()
    assert zc.leaf_module.classes == lmc.DEFAULT_LEAF_MODULE_CLASSES and len(lmc.DEFAULT_LEAF_MODULE_CLASSES) == 3
    assert zc.leaf_module.names == lmc.DEFAULT_LEAF_MODULE_NAMES == []
    assert zc.leaf_module.name_suffixes == lmc.DEFAULT_LEAF_MODULE_NAME_SUFFIXES == []
    lmc.DEFAULT_LEAF_MODULE_NAMES.append("x")  # each access is a fresh list
    assert lmc.DEFAULT_LEAF_MODULE_NAMES == [] and ds_zero.ZeroConfig().leaf_module.names == []
