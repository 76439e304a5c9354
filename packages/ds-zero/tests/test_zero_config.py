"""ZeroConfig: DeepSpeed's keys, defaults, aliases and legacy forms, and errors that name the key path."""

from __future__ import annotations

import pytest

from ds_comm import ConfigDeprecationWarning, ConfigError, validate_section
from ds_zero import ZeroConfig


def _zero(data: dict) -> ZeroConfig:
    return validate_section(ZeroConfig, data, path="zero_optimization")


def test_defaults_match_deepspeed() -> None:
    z = _zero({})
    assert (z.stage, z.contiguous_gradients, z.reduce_scatter, z.reduce_bucket_size) == (0, True, True, 500_000_000)
    assert (z.allgather_partitions, z.allgather_bucket_size, z.overlap_comm) == (True, 500_000_000, False)
    assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.max_live_parameters) == (
        50_000_000,
        100_000,
        1_000_000_000,
    )
    assert (z.offload_optimizer, z.offload_param) == (None, None)  # absent sections stay None, as in DeepSpeed
    off = z.offload_optimizer_or_default
    assert (off.device, off.pin_memory, off.buffer_count) == ("none", True, 4)
    assert (z.offload_param_or_default.buffer_count, z.offload_param_or_default.buffer_size) == (5, 100_000_000)


def test_overlap_comm_defaults_true_for_stage3_only() -> None:
    assert _zero({"stage": 3}).overlap_comm is True
    assert _zero({"stage": 2}).overlap_comm is False
    assert _zero({"stage": 3, "overlap_comm": False}).overlap_comm is False


def test_scientific_notation_and_string_stage() -> None:
    z = _zero({"stage": "2", "reduce_bucket_size": 5e8, "allgather_bucket_size": 2e8})
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size) == (2, 500_000_000, 200_000_000)


def test_stage3_aliases_either_spelling_not_both() -> None:
    assert _zero({"stage": 3, "stage3_max_live_parameters": 10}).max_live_parameters == 10
    assert _zero({"stage": 3, "max_live_parameters": 11}).max_live_parameters == 11
    with pytest.raises(ConfigError, match="set either 'prefetch_bucket_size' or 'stage3_prefetch_bucket_size'"):
        _zero({"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2})


def test_legacy_cpu_offload_maps_with_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="'cpu_offload' is deprecated"):
        z = _zero({"stage": 2, "cpu_offload": True})
    assert z.offload_optimizer.device == "cpu"
    with pytest.warns(ConfigDeprecationWarning, match="stage3_gather_fp16_weights_on_model_save"):
        z = _zero({"stage": 3, "stage3_gather_fp16_weights_on_model_save": True})
    assert z.gather_16bit_weights_on_model_save is True


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"stage": 4}, r"zero_optimization\.stage: Input should be less than or equal to 3"),
        ({"stgae": 2}, r"zero_optimization\.stgae: unknown key 'stgae'; did you mean 'stage'\?"),
        ({"reduce_bucket_size": 0}, r"zero_optimization\.reduce_bucket_size: Input should be greater than 0"),
        ({"reduce_bucket_size": 5.5}, r"zero_optimization\.reduce_bucket_size: .*integer"),
        (
            {"offload_optimizer": {"device": "gpu"}},
            r"zero_optimization\.offload_optimizer\.device: .*'none', 'cpu' or "
            r"'nvme'",
        ),
        ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, r"nvme_path"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, r"ratio=0.5 .*needs stage 3"),
        (
            {"stage": 2, "zero_quantized_gradients": True},
            r"zero_optimization\.zero_quantized_gradients: .*not supported",
        ),
        ({"stage": 1, "legacy_stage1": True}, r"legacy_stage1.*not supported"),
        ({"stage": 3, "compute_grad_norm": False}, r"compute_grad_norm=False is only allowed for stages 1 and 2"),
    ],
)
def test_bad_sections_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _zero(data)


def test_inert_keys_accepted_at_defaults() -> None:
    z = _zero({"stage": 2, "zero_quantized_weights": False, "zero_hpz_partition_size": 1})
    assert z.stage == 2


def test_offload_param_below_stage3_warns_no_effect() -> None:
    with pytest.warns(UserWarning, match="offload_param has no effect at stage 2"):
        _zero({"stage": 2, "offload_param": {"device": "cpu"}})


@pytest.mark.parametrize("data", [{"offload_optimizer": {"device": "cpu"}}, {"cpu_offload": True}])
@pytest.mark.filterwarnings("ignore:config key 'cpu_offload' is deprecated")
def test_offload_optimizer_at_stage0_warns_no_effect_and_keeps_the_section(data: dict) -> None:
    with pytest.warns(UserWarning, match=r"zero_optimization\.offload_optimizer has no effect at stage 0"):
        z = _zero({"stage": 0, **data})
    assert z.offload_optimizer.device == "cpu"  # the section as given, as DeepSpeed keeps it
    assert z.offload_optimizer_device == "none"  # what takes effect


@pytest.mark.parametrize(
    ("short", "long", "value"),
    [
        ("module_granularity_threshold", "stage3_module_granularity_threshold", 5000),
        ("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params", True),
        ("allgather_sequential", "stage3_allgather_sequential", True),
    ],
)
def test_deepspeeds_other_stage3_spellings(short: str, long: str, value: object) -> None:
    assert getattr(_zero({"stage": 3, long: value}), short) == value
    assert getattr(_zero({"stage": 3, short: value}), short) == value
    with pytest.raises(ConfigError, match=f"set either '{short}' or '{long}'"):
        _zero({short: value, long: value})


def test_explicit_null_offload_sections_stay_none() -> None:
    z = _zero({"stage": 3, "offload_param": None, "offload_optimizer": None})
    assert z.offload_param is None and z.offload_optimizer is None
    assert (z.offload_param_device, z.offload_optimizer_device) == ("none", "none")


def test_knobs_without_effect_are_accepted_and_listed() -> None:
    from ds_comm import find_ignored

    z = _zero(
        {
            "stage": 3,
            "contiguous_gradients": False,
            "round_robin_gradients": True,
            "elastic_checkpoint": True,
        }
    )
    found = {path: value for path, value, _ in find_ignored(z, path="zero_optimization")}
    assert found == {
        "zero_optimization.contiguous_gradients": False,
        "zero_optimization.round_robin_gradients": True,
        "zero_optimization.elastic_checkpoint": True,
    }
    assert find_ignored(_zero({"stage": 2, "contiguous_gradients": True}), path="zero_optimization") == []


@pytest.mark.parametrize(("stage", "logged"), [(3, True), (2, False), (1, False)])
def test_stage3_elastic_checkpoint_logs_deprecation_on_deepspeed_logger(
    caplog: pytest.LogCaptureFixture, stage: int, logged: bool
) -> None:
    # DeepSpeed states this deprecation for stage 3 only, on its "DeepSpeed" logger, at validation.
    with caplog.at_level("WARNING", logger="DeepSpeed"):
        _zero({"stage": stage, "elastic_checkpoint": True})
        _zero({"stage": 3, "elastic_checkpoint": False})
    records = [
        r for r in caplog.records if r.name == "DeepSpeed" and "elastic checkpointing is deprecated" in r.message
    ]
    assert len(records) == (1 if logged else 0)
    if logged:
        assert records[0].levelname == "WARNING"
        assert "no effect" in records[0].message
