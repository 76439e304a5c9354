"""`deepspeed.runtime.config`: `DeepSpeedConfig` (a ds_config validated and resolved), its error type and names.

`DeepSpeedConfig(config_dict_or_path)` is what DeepSpeed's tools and tests build to read a config's
sections (`.monitor_config`, `.zero_config`, `.train_batch_size`...) without an engine. The optimizer
name constants (`ADAM_OPTIMIZER`, ...) are the lower-case `optimizer.type` values; `DEEPSPEED_OPTIMIZERS`
lists those the engine builds itself (DeepSpeed's list also names the MuP optimizers, which ds refuses).
`TORCH_ADAM_PARAM` / `ADAM_W_MODE` are the Adam `params` keys choosing torch's Adam and decoupled decay.
`get_gradient_clipping(param_dict)` / `get_log_level(param_dict)` read one key of a raw config dict,
validated and defaulted as a whole config would be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_engine._optim.optimizers import DS_OPTIMIZERS
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.config._key_values import key_value
from ds_engine.runtime.constants import GRADIENT_CLIPPING, LOG_LEVEL

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "ADAM_W_MODE",
    "ADAM_W_MODE_DEFAULT",
    "DEEPSPEED_OPTIMIZERS",
    "LAMB_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUON_OPTIMIZER",
    "TORCH_ADAM_PARAM",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "get_gradient_clipping",
    "get_log_level",
]

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = list(DS_OPTIMIZERS)

TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True


def get_gradient_clipping(param_dict: Mapping[str, Any]) -> float:
    """`gradient_clipping` of a raw config dict (default 1.0; 0 turns clipping off).

    Raises:
        DeepSpeedConfigError: the value is not a non-negative number.
    """
    return key_value(param_dict, GRADIENT_CLIPPING)


def get_log_level(param_dict: Mapping[str, Any]) -> str | None:
    """`log_level` of a raw config dict, as written (`"ERROR"` stays `"ERROR"`); None when absent.

    Raises:
        DeepSpeedConfigError: not one of debug, info, warning, error, critical (any case).
    """
    return key_value(param_dict, LOG_LEVEL)
