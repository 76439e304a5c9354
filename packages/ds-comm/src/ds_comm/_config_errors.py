"""The config vocabulary that needs no pydantic: `UsageError`, `ConfigError`, its warning, the `"auto"` literal.

Kept apart from `ds_comm.config` so that importing ds_comm (and every package above it) does not
import pydantic, which alone costs ~0.3 s; the pydantic models load the first time a config is read.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["AUTO", "Auto", "ConfigDeprecationWarning", "ConfigError", "UsageError"]

#: The literal DeepSpeed users write where a caller (HF Trainer, Accelerate) fills the value in.
AUTO = "auto"
Auto = Literal["auto"]


class UsageError(ValueError, AssertionError):
    """A setting or call that cannot work, refused with a message that names it and the fix.

    [Note: why also an AssertionError] DeepSpeed checks most of these with `assert`, so code written
    for it (and its own tests) catches `AssertionError` around `initialize()`, config parsing and the
    training step. ds raises a ValueError with a real message instead, which would slip past those
    handlers; deriving from both keeps ds's message and type while `except AssertionError` still sees it.
    """


class ConfigError(UsageError):
    """A config value a user wrote is wrong; the message names the key path, the value and the fix."""


class ConfigDeprecationWarning(FutureWarning):
    """A deprecated config key was used; it still works and maps to its replacement."""
