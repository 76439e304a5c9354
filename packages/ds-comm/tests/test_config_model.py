"""ConfigModel: unknown keys, deprecated keys, unsupported keys, "auto", and key paths in errors."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pydantic import Field

import ds_comm
from ds_comm import (
    AUTO,
    Auto,
    CommsLoggerConfig,
    ConfigDeprecationWarning,
    ConfigError,
    ConfigModel,
    find_auto,
    find_ignored,
    validate_section,
    warn_ignored,
)


class Offload(ConfigModel):
    device: str = "none"
    pin_memory: bool = False


class Section(ConfigModel):
    deprecated_keys: ClassVar[dict[str, str]] = {"old_bucket": "bucket_size"}
    unsupported_keys: ClassVar[dict[str, str]] = {"zero_hpz_partition_size": "hierarchical partitioning is not built"}

    stage: int = 0
    bucket_size: int | Auto = 500_000_000
    offload_optimizer: Offload = Offload()


def test_defaults_and_scientific_notation() -> None:
    s = validate_section(Section, {"bucket_size": 5e8}, path="zero_optimization")
    assert s.bucket_size == 500_000_000 and isinstance(s.bucket_size, int)
    assert s.offload_optimizer.device == "none"


def test_unknown_key_names_path_and_suggests() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization\.stgae: unknown key 'stgae'; did you mean 'stage'\?"):
        validate_section(Section, {"stgae": 2}, path="zero_optimization")


def test_config_errors_are_value_and_assertion_errors() -> None:
    """Code written for DeepSpeed catches its asserted config checks as AssertionError; ds's errors still match."""
    for caught in (ValueError, AssertionError, ds_comm.UsageError):
        with pytest.raises(caught, match=r"zero_optimization\.stgae: unknown key"):
            validate_section(Section, {"stgae": 2}, path="zero_optimization")


def test_nested_unknown_key_has_full_path() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization\.offload_optimizer\.devcie: .*did you mean 'device'"):
        validate_section(Section, {"offload_optimizer": {"devcie": "cpu"}}, path="zero_optimization")


def test_unknown_key_without_close_match_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"valid keys: bucket_size, offload_optimizer, old_bucket, stage"):
        validate_section(Section, {"qqqqqq": 1}, path="zero_optimization")


def test_wrong_type_names_path_and_value() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage: .*integer.*\(got 'two'\)"):
        validate_section(Section, {"stage": "two"}, path="zero_optimization")


def test_deprecated_key_warns_and_maps() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="'old_bucket' is deprecated; use 'bucket_size'"):
        s = validate_section(Section, {"old_bucket": 10}, path="zero_optimization")
    assert s.bucket_size == 10


def test_deprecated_and_new_key_together_is_an_error() -> None:
    with pytest.raises(ConfigError, match="both 'old_bucket' .* and 'bucket_size' are set"):
        with pytest.warns(ConfigDeprecationWarning):
            validate_section(Section, {"old_bucket": 10, "bucket_size": 3}, path="z")


def test_unsupported_key_is_an_error_not_ignored() -> None:
    with pytest.raises(
        ConfigError,
        match=r"z\.zero_hpz_partition_size: key 'zero_hpz_partition_size' is not "
        r"supported by ds: hierarchical",
    ):
        validate_section(Section, {"zero_hpz_partition_size": 8}, path="z")


def test_auto_allowed_where_typed_and_found() -> None:
    s = validate_section(Section, {"bucket_size": AUTO}, path="zero_optimization")
    assert find_auto(s, path="zero_optimization") == ["zero_optimization.bucket_size"]
    filled = s.model_copy(update={"bucket_size": 1024})
    assert find_auto(filled) == []
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        validate_section(Section, {"stage": AUTO}, path="zero_optimization")


def test_models_are_frozen() -> None:
    s = Section()
    with pytest.raises(Exception, match="frozen"):
        s.stage = 3  # type: ignore[misc]


def test_comms_logger_defaults_match_deepspeed() -> None:
    c = CommsLoggerConfig()
    assert (c.enabled, c.verbose, c.prof_all, c.prof_ops, c.debug) == (False, False, True, [], False)
    with pytest.raises(ConfigError, match=r"comms_logger\.prof_al: .*did you mean 'prof_all'"):
        validate_section(CommsLoggerConfig, {"prof_al": True}, path="comms_logger")


class WithInert(ConfigModel):
    inert_keys: ClassVar[dict[str, str]] = {"zero_quantized_weights": "ZeRO++ is not built"}

    stage: int = 0
    zero_quantized_weights: bool = False


def test_inert_key_accepted_at_default_and_refused_otherwise() -> None:
    assert validate_section(WithInert, {"zero_quantized_weights": False}).zero_quantized_weights is False
    with pytest.raises(
        ConfigError,
        match=r"z\.zero_quantized_weights: 'zero_quantized_weights'=True is not supported "
        r"by ds \(ZeRO\+\+ is not built\); only the default False is accepted",
    ):
        validate_section(WithInert, {"zero_quantized_weights": True}, path="z")


class WithAliasedInert(ConfigModel):
    inert_keys: ClassVar[dict[str, str]] = {"granularity": "not built"}

    granularity: int = Field(0, alias="stage3_granularity")


def test_inert_key_is_refused_under_its_alias_too() -> None:
    assert validate_section(WithAliasedInert, {"stage3_granularity": 0}).granularity == 0
    with pytest.raises(ConfigError, match=r"z\.stage3_granularity: 'stage3_granularity'=4 is not supported"):
        validate_section(WithAliasedInert, {"stage3_granularity": 4}, path="z")


class Inner(ConfigModel):
    ignored_keys: ClassVar[dict[str, str]] = {"cores": "threads come from torch"}

    cores: float = 0.8


class WithIgnored(ConfigModel):
    ignored_keys: ClassVar[dict[str, str]] = {"contiguous": "always contiguous"}

    contiguous: bool = True
    inner: Inner = Inner()


def test_ignored_keys_are_found_with_their_path_when_not_default() -> None:
    assert find_ignored(validate_section(WithIgnored, {"contiguous": True, "inner": {"cores": 0.8}})) == []
    model = validate_section(WithIgnored, {"contiguous": False, "inner": {"cores": 0.5}})
    assert find_ignored(model, path="zero") == [
        ("zero.contiguous", False, "always contiguous"),
        ("zero.inner.cores", 0.5, "threads come from torch"),
    ]
    with pytest.warns(UserWarning) as record:
        warn_ignored(model, path="zero")
    assert [str(w.message) for w in record] == [
        "zero.contiguous=False has no effect in ds (always contiguous)",
        "zero.inner.cores=0.5 has no effect in ds (threads come from torch)",
    ]
