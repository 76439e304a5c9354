"""DeepSpeedConfig: the four input forms, "auto" placeholders, legacy forms, attribute access, no mutation."""

from __future__ import annotations

import base64
import json
import warnings

import pytest

from ds_comm import ConfigDeprecationWarning
from ds_engine import DeepSpeedConfig, DeepSpeedConfigError

BASIC = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_dict_json_hjson_and_base64_give_the_same_config(tmp_path) -> None:
    as_json = tmp_path / "ds.json"
    as_json.write_text(json.dumps(BASIC))
    as_hjson = tmp_path / "ds.hjson"
    as_hjson.write_text(
        "{\n  # comments and unquoted keys are fine in hjson\n  train_batch_size: 8\n"
        "  optimizer: {\n    type: AdamW\n    params: {lr: 0.001}\n  }\n}\n"
    )
    encoded = base64.urlsafe_b64encode(json.dumps(BASIC).encode()).decode()
    configs = [
        DeepSpeedConfig(BASIC),
        DeepSpeedConfig(str(as_json)),
        DeepSpeedConfig(as_hjson),
        DeepSpeedConfig(encoded),
    ]
    for cfg in configs:
        assert cfg.train_batch_size == 8 and cfg.optimizer_name == "adamw"
        assert cfg.optimizer_params == {"lr": 1e-3}
    assert configs[1].source == str(as_json)


def test_the_callers_dict_is_not_modified() -> None:
    raw = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}}
    before = json.dumps(raw, sort_keys=True)
    DeepSpeedConfig(raw, auto_values={"optimizer.params.lr": 0.1})
    assert json.dumps(raw, sort_keys=True) == before


def test_duplicate_keys_in_a_file_are_an_error(tmp_path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(DeepSpeedConfigError, match=r"duplicate keys in the config: \['train_batch_size'\]"):
        DeepSpeedConfig(path)


def test_missing_file_and_garbage_string_have_clear_messages(tmp_path) -> None:
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        DeepSpeedConfig(str(tmp_path / "nope.json"))
    with pytest.raises(DeepSpeedConfigError, match="expected a path to an existing config file, a dict, or base64"):
        DeepSpeedConfig("not-a-config")
    bad = tmp_path / "bad.json"
    bad.write_text("{train_batch_size: [}")
    with pytest.raises(DeepSpeedConfigError, match="is not valid JSON/hjson"):
        DeepSpeedConfig(bad)
    with pytest.raises(DeepSpeedConfigError, match="must be a JSON object at the top level"):
        DeepSpeedConfig(base64.urlsafe_b64encode(b"[1, 2]").decode())
    with pytest.raises(TypeError, match="config must be a dict"):
        DeepSpeedConfig(42)  # type: ignore[arg-type]


def test_auto_placeholders_are_tracked_filled_and_refused_until_filled() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}},
        "gradient_clipping": "auto",
    }
    cfg = DeepSpeedConfig(raw)
    assert cfg.auto_keys == ("train_micro_batch_size_per_gpu", "optimizer.params.lr", "gradient_clipping")
    assert cfg.batch is None
    with pytest.raises(
        DeepSpeedConfigError,
        match=r"train_micro_batch_size_per_gpu, optimizer\.params\.lr, "
        r'gradient_clipping: still "auto"',
    ):
        cfg.check_resolved()
    with pytest.raises(DeepSpeedConfigError, match='still "auto"'):
        _ = cfg.train_batch_size
    filled = cfg.fill_auto(
        {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer.params.lr": 3e-4,
            "gradient_clipping": 0.5,
            "optimizer.params.weight_decay": 9.0,
        }
    )
    filled.check_resolved()
    assert filled.train_batch_size == 8 and filled.gradient_clipping == 0.5
    # An explicit user value wins over the caller's fill value, as in the HF integration.
    assert filled.optimizer_params == {"lr": 3e-4, "weight_decay": 0.1}
    same = DeepSpeedConfig(
        raw, auto_values={"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 3e-4, "gradient_clipping": 0.5}
    )
    assert same.raw == filled.raw


def test_world_size_resolves_the_batch_and_can_be_changed() -> None:
    cfg = DeepSpeedConfig({"train_batch_size": 32, "gradient_accumulation_steps": 2}, world_size=4)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.world_size_source) == (4, "given")
    assert cfg.with_world_size(2).train_micro_batch_size_per_gpu == 8


def test_legacy_forms_map_with_a_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="bfloat16"):
        cfg = DeepSpeedConfig({"train_batch_size": 2, "bfloat16": {"enabled": True}})
    assert cfg.bfloat16_enabled and cfg.precision == "bf16"
    with pytest.warns(ConfigDeprecationWarning, match='"zero_optimization": false is deprecated'):
        cfg = DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": False})
    assert cfg.zero_optimization_stage == 0 and not cfg.zero_enabled


def test_sections_and_keys_read_by_name_with_deepspeed_defaults() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale_window": 50}})
    assert cfg.fp16.loss_scale_window == 50 and cfg.fp16.hysteresis == 2 and cfg.fp16.initial_scale_power == 16
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None and cfg.checkpoint.tag_validation == "WARN"
    assert cfg.fp16.dynamic_loss_args() == {
        "init_scale": 65536.0,
        "scale_window": 50,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "min_scale": 1.0,
    }
    assert cfg.zero_optimization_stage == 0 and cfg.gradient_accumulation_steps == 1
    with pytest.raises(AttributeError, match="no attribute or config key 'nonsense'"):
        _ = cfg.nonsense


def test_scientific_notation_and_case_insensitive_enums() -> None:
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 4e0,
            "checkpoint": {"tag_validation": "fail"},
            "gradient_allreduce_op": "SUM",
            "communication_data_type": "bfloat16",
            "optimizer": {"type": "adam"},
        }
    )
    assert cfg.train_batch_size == 4 and cfg.checkpoint.tag_validation == "FAIL"
    assert cfg.gradient_allreduce_op == "sum" and cfg.communication_data_type == "bf16"


def test_off_sections_are_accepted_only_when_off() -> None:
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 2,
            "hybrid_engine": {"enabled": False, "max_out_tokens": 512},
            "autotuning": {"enabled": False},
            "compile": {"deepcompile": False},
            "tensor_parallel": {"autotp_size": 1},
            "flops_profiler": {"enabled": False},
        }
    )
    assert cfg.train_batch_size == 2
