"""DeepSpeed 0.19.8 config keys the engine now takes as DeepSpeed does: `log_level` (applied at initialize),
`datastates_ckpt` (only false), explicit null offload sections, `data_parallel_size`, and knobs without effect
(accepted, with one warning naming the key path)."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
from ds_engine_testkit import base_config, make_engine, tiny_net

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.utils.logging import DS_LOGGERS, get_log_level_from_string, set_log_level_from_string


def _config(**keys: object) -> DeepSpeedConfig:
    return DeepSpeedConfig({"train_batch_size": 2, **keys}, world_size=1)


def test_log_level_sets_every_ds_logger_at_initialize() -> None:
    saved = {name: logging.getLogger(name).level for name in DS_LOGGERS}
    try:
        make_engine(tiny_net(0), base_config(log_level="ERROR"))
        assert {logging.getLogger(name).level for name in DS_LOGGERS} == {logging.ERROR}
        assert logging.getLogger("ds_zero._stage3.optimizer").getEffectiveLevel() == logging.ERROR
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
    assert _config().parsed.log_level is None
    with pytest.raises(DeepSpeedConfigError, match=r"log_level: log level 'loud' is not one of debug, info"):
        _config(log_level="loud")


def test_log_level_helpers() -> None:
    assert get_log_level_from_string("Warning") == logging.WARNING
    with pytest.raises(ValueError, match="'verbose' is not one of debug, info"):
        get_log_level_from_string("verbose")
    custom = logging.getLogger("engineapi-test")
    handler = logging.NullHandler()
    custom.addHandler(handler)
    set_log_level_from_string("debug", custom_logger=custom)
    assert custom.level == handler.level == logging.DEBUG
    custom.removeHandler(handler)


def test_datastates_ckpt_only_off() -> None:
    assert _config(datastates_ckpt=False).parsed.datastates_ckpt is False
    with pytest.raises(DeepSpeedConfigError, match=r"datastates_ckpt: DataStates checkpointing is not implemented"):
        _config(datastates_ckpt={"host_cache_size": 16})
    with pytest.raises(DeepSpeedConfigError, match=r"unknown key 'datastates'; did you mean 'datastates_ckpt'"):
        _config(datastates={})


def test_null_offload_sections() -> None:
    pytest.importorskip("ds_zero")
    cfg = _config(zero_optimization={"stage": 2, "offload_optimizer": None, "offload_param": None})
    assert cfg.zero.offload_optimizer_device == "none" and cfg.zero.offload_param_device == "none"
    assert cfg.zero_config.offload_param is None and cfg.zero_config.offload_optimizer is None  # as DeepSpeed


def test_knobs_without_effect_warn_with_their_key_path() -> None:
    pytest.importorskip("ds_zero")
    with pytest.warns(UserWarning, match=r"zero_optimization\.round_robin_gradients=True has no effect in ds"):
        _config(zero_optimization={"stage": 2, "round_robin_gradients": True})
    with pytest.warns(
        UserWarning, match=r"elastic_checkpoint=True has no effect in ds \(elastic checkpointing is deprecated"
    ):
        _config(zero_optimization={"stage": 3, "elastic_checkpoint": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DeepSpeed's defaults spelled out: silent
        _config(zero_optimization={"stage": 2, "contiguous_gradients": True, "round_robin_gradients": False})


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"disable_allgather": True}, r"^disable_allgather=True has no effect in ds \(DeepSpeed 0.19.8 reads it but"),
        (
            {"compile": {"free_activation": True}},
            r"^compile.free_activation=True has no effect in ds \(it tunes DeepSpeed's CUDA DeepCompile; ds's passes",
        ),
        (
            {"weight_quantization": {"num_bits": 4}},
            r"^weight_quantization.num_bits=4 has no effect in ds \(DeepSpeed does not read the section's own",
        ),
        (
            {"optimizer": {"type": "AdamW", "legacy_fusion": True}, "bf16": {"enabled": True}},
            r"^optimizer.legacy_fusion=True has no effect in ds \(DeepSpeed reads it only in its fp16 ZeRO-0",
        ),
        (
            {"data_parallel_size": 2},
            r"^data_parallel_size=2 has no effect without sequence_parallel_size: DeepSpeed reads it only to build",
        ),
    ],
)
def test_keys_deepspeed_reads_without_effect_here_warn_once_naming_the_key(keys: dict, message: str) -> None:
    if "weight_quantization" in keys:
        pytest.importorskip("ds_zero")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config(**keys)
    matching = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(matching) == 1 and re.match(message, matching[0]), matching


def test_data_parallel_size_with_sequence_parallel_size() -> None:
    """With `sequence_parallel_size`, DeepSpeed builds its (data, sequence) mesh from both: here the degree
    must match what the world leaves (one rank: 1), and no warning is given."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_engine(tiny_net(0), base_config(data_parallel_size=1, sequence_parallel_size=1))
    with pytest.raises(ValueError, match=r"data_parallel_size=4 with sequence_parallel_size=1, but the data-par"):
        make_engine(tiny_net(0), base_config(data_parallel_size=4, sequence_parallel_size=1))


def test_min_loss_scale_against_the_start_of_the_scale() -> None:
    """DeepSpeed 0.19.8 accepts a floor above the dynamic start (the first overflow then raises the scale);
    ds refuses it naming both keys. With a static loss_scale the floor is unused (DeepSpeed's validator leaves
    such configs valid on purpose), so there it only warns."""
    with pytest.raises(DeepSpeedConfigError, match=r"fp16: min_loss_scale=64.0 is above the initial loss scale"):
        _config(fp16={"enabled": True, "initial_scale_power": 4, "min_loss_scale": 64})
    _config(fp16={"enabled": True, "initial_scale_power": 6, "min_loss_scale": 64})  # equal: the floor is the start
    _config(fp16={"enabled": False, "initial_scale_power": 4, "min_loss_scale": 64})  # off: nothing is scaled
    with pytest.warns(UserWarning, match=r"fp16.min_loss_scale=64.0 is above the static fp16.loss_scale=8 and has"):
        _config(fp16={"enabled": True, "loss_scale": 8, "min_loss_scale": 64})
