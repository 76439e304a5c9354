"""`deepspeed.runtime.precision_config`: the `fp16` and `bf16` section models under DeepSpeed's names.

`DeepSpeedFP16Config` / `DeepSpeedBF16Config` are the models ds-engine validates those sections with
(`ds_engine.config.FP16Config` / `BF16Config`), so a value DeepSpeed refuses or accepts there is judged
the same way whether it comes through a whole ds_config or one of these classes.
`get_float16_config(ds_config)` / `get_bfloat16_config(ds_config)` read the section out of a whole
ds_config dict (`bf16`, or its legacy name `bfloat16`); an invalid section is a `ConfigError` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ds_comm
from ds_engine.config._sections import BF16Config as DeepSpeedBF16Config
from ds_engine.config._sections import FP16Config as DeepSpeedFP16Config

__all__ = [
    "BFLOAT16",
    "BFLOAT16_OLD",
    "FP16",
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "get_bfloat16_config",
    "get_float16_config",
]

FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"


def _section(param_dict: Mapping[str, Any], *keys: str) -> tuple[str, Any]:
    if not isinstance(param_dict, Mapping):
        raise TypeError(f"expected a ds_config dict, got {type(param_dict).__name__}")
    for key in keys:
        if param_dict.get(key) is not None:
            return key, param_dict[key]
    return keys[0], {}


def get_float16_config(param_dict: Mapping[str, Any]) -> DeepSpeedFP16Config:
    """The `fp16` section of a ds_config dict (defaults when absent)."""
    key, section = _section(param_dict, FP16)
    return ds_comm.validate_section(DeepSpeedFP16Config, section, path=key)


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The `bf16` section of a ds_config dict, or its legacy name `bfloat16` (defaults when neither is there)."""
    key, section = _section(param_dict, BFLOAT16, BFLOAT16_OLD)
    return ds_comm.validate_section(DeepSpeedBF16Config, section, path=key)
