"""`DeepSpeedConfigError`: every config problem a user can cause, named by key path."""

from __future__ import annotations

from ds_comm import ConfigError

__all__ = ["DeepSpeedConfigError", "ParamDtypeConflictError"]


class DeepSpeedConfigError(ConfigError):
    """A ds_config value is wrong, missing or unsupported.

    A `ValueError` (through `ds_comm.ConfigError`), so `except ValueError` and DeepSpeed-style
    `except DeepSpeedConfigError` both catch it. The message starts with the key path
    (`fp16.loss_scale_window: ...`) and says what to change.
    """


class ParamDtypeConflictError(DeepSpeedConfigError, AssertionError):
    """`data_types.param_dtype` disagrees with the fp16/bf16 switches.

    Also an `AssertionError`, the type DeepSpeed's engine raises for this conflict (its callers and
    tests catch that), while ds callers catch it as a `ValueError` like every other config error.
    """
