"""`ConfigModel`: the pydantic base of every package's config section, with errors that name the key path."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ds_comm._config_errors import AUTO, Auto, ConfigDeprecationWarning, ConfigError

__all__ = [
    "AUTO",
    "Auto",
    "CommsLoggerConfig",
    "ConfigError",
    "ConfigDeprecationWarning",
    "ConfigModel",
    "find_auto",
    "find_ignored",
    "validate_section",
    "warn_ignored",
]

M = TypeVar("M", bound="ConfigModel")


class ConfigModel(BaseModel):
    """Base of every config section (`zero_optimization`, `fp16`, `comms_logger`, ...).

    Frozen, and strict about keys: an unknown key is an error naming the key and the closest
    valid one. Subclasses declare, as class variables:

    - `deprecated_keys`: old key -> new key. The old key warns once per validation and maps.
    - `unsupported_keys`: key DeepSpeed accepts but ds does not implement -> why. Using one is
      an error, never silently ignored.
    - `inert_keys`: fields DeepSpeed accepts whose feature ds does not implement -> why. They are
      accepted at their default value (configs written for DeepSpeed often spell defaults out) and
      an error at any other value.
    - `ignored_keys`: fields DeepSpeed reads that have no effect in ds (a tuning knob whose job ds
      does another way) -> why. Any value is accepted; `find_ignored` lists the ones set to a
      non-default value so the caller can warn, naming the key path.

    Fields that accept `"auto"` say so in their type (`int | Auto`); `find_auto` lists the ones
    still unresolved so assembly can refuse them by name.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
        arbitrary_types_allowed=True,
    )

    deprecated_keys: ClassVar[dict[str, str]] = {}
    unsupported_keys: ClassVar[dict[str, str]] = {}
    inert_keys: ClassVar[dict[str, str]] = {}
    ignored_keys: ClassVar[dict[str, str]] = {}

    @classmethod
    def valid_keys(cls) -> list[str]:
        """Every key this section accepts (field names, their aliases, deprecated names)."""
        keys: list[str] = []
        for name, field in cls.model_fields.items():
            keys.append(name)
            if field.alias and field.alias != name:
                keys.append(field.alias)
        keys.extend(cls.deprecated_keys)
        return keys

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for key in list(data):
            if key in cls.unsupported_keys:
                raise PydanticCustomError(
                    "unsupported_key",
                    "key {shown} is not supported by ds: {reason}",
                    {"key": key, "shown": repr(key), "reason": cls.unsupported_keys[key]},
                )
            if key in cls.deprecated_keys:
                new = cls.deprecated_keys[key]
                warnings.warn(
                    f"config key {key!r} is deprecated; use {new!r} (mapped for you)",
                    ConfigDeprecationWarning,
                    stacklevel=2,
                )
                value = data.pop(key)
                if new in data:
                    raise PydanticCustomError(
                        "duplicate_key",
                        "both {old} (deprecated) and {new} are set; keep only {new}",
                        {"old": repr(key), "new": repr(new)},
                    )
                data[new] = value
        for name, reason in cls.inert_keys.items():
            alias = cls.model_fields[name].alias
            for key in (name, alias) if alias else (name,):
                if key in data and data[key] != cls.model_fields[name].default:
                    raise PydanticCustomError(
                        "unsupported_key",
                        "{shown}={value} is not supported by ds ({reason}); only the default {default} is accepted",
                        {
                            "key": key,
                            "shown": repr(key),
                            "value": repr(data[key]),
                            "reason": reason,
                            "default": repr(cls.model_fields[name].default),
                        },
                    )
        valid = cls.valid_keys()
        for key in data:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
                raise PydanticCustomError(
                    "unknown_key",
                    "unknown key {shown}{hint}",
                    {"key": key, "shown": repr(key), "hint": hint},
                )
        return data


def _format_error(error: Mapping[str, Any], prefix: str) -> str:
    loc = [str(part) for part in error.get("loc", ())]
    path = ".".join([p for p in [prefix, *loc] if p])
    kind = error.get("type", "")
    if kind in ("unknown_key", "unsupported_key"):
        key = error["ctx"]["key"]
        path = f"{path}.{key}" if path else str(key)
    where = path or "<config>"
    message = error.get("msg", "invalid value")
    if kind not in ("unknown_key", "unsupported_key", "duplicate_key", "value_error") and "input" in error:
        shown = repr(error["input"])
        if len(shown) > 80:
            shown = shown[:77] + "..."
        message = f"{message} (got {shown})"
    return f"{where}: {message}"


def validate_section(model: type[M], data: Any, *, path: str = "") -> M:
    """Validate `data` as `model`, turning pydantic's report into a `ConfigError` keyed by path.

    Args:
        model: the section's `ConfigModel` subclass.
        data: the raw section (a dict, or an existing instance of `model`).
        path: the section's key path in the whole config (`"zero_optimization"`), used as the
            prefix of every key in the message.

    Raises:
        ConfigError: one line per problem, each starting with the full key path.
    """
    if isinstance(data, model):
        return data
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", ConfigDeprecationWarning)
            return model.model_validate(data)
    except ValidationError as err:
        lines = [_format_error(e, path) for e in err.errors(include_url=False)]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def find_auto(model: BaseModel, *, path: str = "") -> list[str]:
    """Key paths in `model` (recursively) whose value is still the string `"auto"`."""
    found: list[str] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        key = f"{path}.{name}" if path else name
        if isinstance(value, str) and value == AUTO:
            found.append(key)
        elif isinstance(value, BaseModel):
            found.extend(find_auto(value, path=key))
    return found


def find_ignored(model: BaseModel, *, path: str = "") -> list[tuple[str, Any, str]]:
    """`(key path, value, reason)` of every `ignored_keys` field (recursively) set to a non-default value."""
    found: list[tuple[str, Any, str]] = []
    ignored = getattr(type(model), "ignored_keys", {})
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        key = f"{path}.{name}" if path else name
        if name in ignored and value != field.default:
            found.append((key, value, ignored[name]))
        elif isinstance(value, BaseModel):
            found.extend(find_ignored(value, path=key))
    return found


def warn_ignored(model: BaseModel, *, path: str = "") -> None:
    """One `UserWarning` per `find_ignored` entry: "<key path>=<value> has no effect in ds (<why>)"."""
    for key, value, reason in find_ignored(model, path=path):
        warnings.warn(f"{key}={value!r} has no effect in ds ({reason})", UserWarning, stacklevel=2)


class CommsLoggerConfig(ConfigModel):
    """The `comms_logger` section: per-op counts, bytes, latency and bandwidth of collectives."""

    enabled: bool = False
    """Record collectives at all."""
    verbose: bool = False
    """Log every recorded op as it completes (rank 0), not only in the summary."""
    prof_all: bool = True
    """Record every op; when False only the ops in `prof_ops`."""
    prof_ops: list[str] = []
    """Op names to record when `prof_all` is False (e.g. `["all_reduce", "all_gather"]`)."""
    debug: bool = False
    """Append the calling function's name to each record, to tell call sites apart."""
