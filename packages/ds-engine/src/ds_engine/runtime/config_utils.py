"""`deepspeed.runtime.config_utils`: `DeepSpeedConfigModel`, the base other projects write their config classes on.

Code written against DeepSpeed subclasses `DeepSpeedConfigModel` and relies on three behaviours, kept here:

- construction drops values that are the string `"auto"` (a field left to be filled in falls back to its
  default; `strict=True` keeps them), unknown keys are errors, and assignment is validated;
- a field declared with `Field(..., json_schema_extra={"deprecated": True, "new_param": "x",
  "new_param_fn": f})` is deprecated: using it warns (`ds_comm.ConfigDeprecationWarning`) and sets `x` to
  `f(value)` (`new_param` may be a dotted path into a sub-model; `"set_new_param": False` only warns;
  `"deprecated_msg"` is appended to the warning);
- giving both a deprecated field and its replacement is an error (`DeprecatedAndNewKeyError`, which is an
  `AssertionError` as DeepSpeed raises there, and a `ds_comm.ConfigError`).

It is built on `ds_comm.ConfigModel` (so unknown keys get its closest-key suggestion) but, unlike ds's own
sections, is mutable. `get_scalar_param` and `dict_raise_error_on_duplicate_keys` are DeepSpeed's small readers
of raw config dicts.
"""

from __future__ import annotations

import collections
import functools
import warnings
from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict

import ds_comm

__all__ = [
    "DeepSpeedConfigModel",
    "DeprecatedAndNewKeyError",
    "dict_raise_error_on_duplicate_keys",
    "get_scalar_param",
]


class DeprecatedAndNewKeyError(ds_comm.ConfigError):
    """A deprecated config field and the field replacing it were both given (an AssertionError too, as all
    ds_comm.ConfigErrors are)."""


class DeepSpeedConfigModel(ds_comm.ConfigModel):
    """A mutable config model with DeepSpeed's `"auto"` dropping and deprecated-field mapping (see the module)."""

    model_config = ConfigDict(
        frozen=False,
        validate_assignment=True,
        validate_default=True,
        use_enum_values=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            # `replace_method="auto"` is a real value of DeepSpeed's inference config, not a placeholder.
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto") or k == "replace_method"}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, Mapping) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._map_deprecated(name, extra)

    def _map_deprecated(self, name: str, extra: Mapping[str, Any]) -> None:
        new_param = str(extra.get("new_param", ""))
        message = f"config key {name!r} is deprecated" + (f"; use {new_param!r}" if new_param else "")
        if extra.get("deprecated_msg"):
            message += f". {extra['deprecated_msg']}"
        warnings.warn(message, ds_comm.ConfigDeprecationWarning, stacklevel=3)
        if not new_param or not extra.get("set_new_param", True):
            return
        *parents, leaf = new_param.split(".")
        target = functools.reduce(getattr, parents, self)
        if leaf in target.model_fields_set:
            raise DeprecatedAndNewKeyError(
                f"config keys {name!r} (deprecated) and {new_param!r} are both set; keep only {new_param!r}"
            )
        convert = extra.get("new_param_fn", lambda value: value)
        setattr(target, leaf, convert(getattr(self, name)))


def get_scalar_param(param_dict: Mapping[str, Any], param_name: str, param_default_value: Any) -> Any:
    """`param_dict[param_name]`, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A `json.load(object_pairs_hook=...)` that refuses a key given twice in one object.

    Raises:
        ValueError: naming the duplicated keys.
    """
    counts = collections.Counter(key for key, _ in ordered_pairs)
    duplicates = sorted(key for key, n in counts.items() if n > 1)
    if duplicates:
        raise ValueError(f"duplicate keys in the config: {duplicates}")
    return dict(ordered_pairs)
