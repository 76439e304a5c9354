"""Every ds_config key DeepSpeed 0.19.8 reads (`deepspeed_config_keys.py`) is known to ds, one key at a time on top of
a minimal config: accepted with DeepSpeed's example value, or, for a section the minimal config cannot run
(ZenFlow needs ZeRO 1-3 with CPU offload), refused with a message naming the section, never "unknown key". A typo of
any section key is an error naming it and suggesting the real key.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from typing import Any

import pytest
from deepspeed_config_keys import DEEPSPEED_CONFIG_KEYS, INFERENCE_CONFIG_KEYS, REMOVED_KEYS, nested

from ds_comm import ConfigDeprecationWarning, ConfigError, validate_section
from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.inference.config import DeepSpeedInferenceConfig

BASE: dict[str, Any] = {"train_batch_size": 2}

#: key path prefix -> what ds answers when the section is given at all (a feature it does not implement)
REFUSED_SECTIONS = {
    # ZenFlow needs ZeRO 1-3 with CPU optimizer offload, which the minimal config does not have
    "zero_optimization.zenflow.": r"zero_optimization.zenflow needs zero_optimization.stage 1, 2 or 3",
}

#: sections validated by an optional sibling package (without it the key is refused naming the extra)
NEEDS = {
    "zero_optimization": "ds_zero",
    "weight_quantization": "ds_zero",
    "pipeline": "ds_pipe",
    "activation_checkpointing": "ds_pipe",
}

#: free-form mappings in DeepSpeed (constructor arguments, per-metric settings): no key list to suggest from
FREE_FORM = (
    "optimizer.params.",
    "scheduler.params.",
    "tensor_parallel.partition_config",
)

#: the legacy spellings that announce their new name when used (a ConfigDeprecationWarning)
LEGACY = ("bfloat16", "zero_optimization.cpu_offload", "zero_optimization.stage3_gather_fp16_weights")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _marks(path: str) -> Any:
    module = NEEDS.get(path.split(".")[0])
    if module is not None and importlib.util.find_spec(module) is None:
        return pytest.mark.skip(reason=f"{path.split('.')[0]} is validated by {module}, not installed")
    return []


def _params(table: dict[str, Any]) -> list[Any]:
    return [pytest.param(path, value, id=path, marks=_marks(path)) for path, value in table.items()]


@pytest.mark.parametrize(("path", "value"), _params(DEEPSPEED_CONFIG_KEYS))
def test_deepspeed_key_is_known(path: str, value: Any) -> None:
    config = _merge(BASE, nested(path, value))
    refused = next((msg for prefix, msg in REFUSED_SECTIONS.items() if path.startswith(prefix)), None)
    if refused is not None:
        with pytest.raises(DeepSpeedConfigError, match=refused) as info:
            DeepSpeedConfig(config, world_size=1)
        assert "unknown key" not in str(info.value)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = DeepSpeedConfig(config, world_size=1)
    # DeepSpeed's own "auto" values are values, not placeholders a caller must fill
    assert parsed.auto_keys == ()
    # a value DeepSpeed documents as its default never draws a "no effect" warning
    unexpected = [
        str(w.message)
        for w in caught
        if not (issubclass(w.category, ConfigDeprecationWarning) and path.startswith(LEGACY))
        and not str(w.message).startswith("data_parallel_size=1 has no effect without sequence_parallel_size")
    ]
    assert unexpected == []


@pytest.mark.parametrize(("path", "value"), _params(REMOVED_KEYS))
def test_removed_keys_are_refused_by_name_or_accepted_at_their_old_default(path: str, value: Any) -> None:
    config = _merge(BASE, nested(path, value))
    if "." in path:  # zero_optimization's MiCS / LoCo keys: only their defaults
        DeepSpeedConfig(config, world_size=1)
        return
    with pytest.raises(DeepSpeedConfigError, match=rf"{path}: key '{path}' is not supported by ds: .*"):
        DeepSpeedConfig(config, world_size=1)


@pytest.mark.parametrize(("path", "value"), [pytest.param(p, v, id=p) for p, v in INFERENCE_CONFIG_KEYS.items()])
def test_inference_key_is_known(path: str, value: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigDeprecationWarning)  # mp_size / mpu announce their new place
        validate_section(DeepSpeedInferenceConfig, nested(path, value))


def _typo_rows() -> list[Any]:
    rows = []
    for path in DEEPSPEED_CONFIG_KEYS:
        if path.startswith(FREE_FORM) or path.startswith(tuple(REFUSED_SECTIONS)):
            continue
        rows.append(pytest.param(path, id=path, marks=_marks(path)))
    return rows


@pytest.mark.parametrize("path", _typo_rows())
def test_a_typo_is_an_error_with_a_suggestion(path: str) -> None:
    *parents, leaf = path.split(".")
    typo = f"{leaf}x"
    config = _merge(BASE, nested(".".join([*parents, typo]), 1))
    # the legacy section name is read as "bf16" (mapped before validation), so the path names that
    shown = ".".join(["bf16" if p == "bfloat16" else p for p in parents] + [typo])
    with pytest.raises(ConfigError, match=rf"{re.escape(shown)}: unknown key '{typo}'.*did you mean '{leaf}'"):
        DeepSpeedConfig(config, world_size=1)


def test_inference_typo_is_an_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"max_out_tokenz: unknown key .*did you mean 'max_out_tokens'"):
        validate_section(DeepSpeedInferenceConfig, {"max_out_tokenz": 8})


def test_the_table_covers_every_section() -> None:
    sections = {path.split(".")[0] for path in DEEPSPEED_CONFIG_KEYS}
    assert len(DEEPSPEED_CONFIG_KEYS) > 350 and len(sections) > 40
