"""One top-level ds_config key read on its own, validated and defaulted by the config model.

DeepSpeed's `get_<key>(param_dict)` helpers (`get_gradient_clipping`, `get_log_level`) read one key of a
raw config dict. Here each is the model's own field: the value is validated exactly as a whole config's
would be (same errors, same key path) and the default is the field's, so no default lives twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_engine.config._deepspeed_config import validate_model
from ds_engine.config._errors import DeepSpeedConfigError
from ds_engine.config._toplevel import DeepSpeedConfigModel

__all__ = ["key_default", "key_value"]


def key_default(key: str) -> Any:
    """The default of top-level config `key` (`"gradient_clipping"` -> 1.0).

    Raises:
        DeepSpeedConfigError: `key` is not a top-level ds_config key.
    """
    field = DeepSpeedConfigModel.model_fields.get(key)
    if field is None:
        raise DeepSpeedConfigError(f"{key!r} is not a top-level ds_config key")
    return field.get_default(call_default_factory=True)


def key_value(param_dict: Mapping[str, Any], key: str) -> Any:
    """`param_dict[key]` validated as in a whole config, or the key's default when it is absent.

    Raises:
        DeepSpeedConfigError: the value is invalid (the message starts with `key`), or `key` is unknown.
    """
    default = key_default(key)
    if key not in param_dict:
        return default
    return getattr(validate_model({key: param_dict[key]}), key)
