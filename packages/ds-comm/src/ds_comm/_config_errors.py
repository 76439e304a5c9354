"""The config vocabulary that needs no pydantic: `ConfigError`, its warning, and the `"auto"` literal.

Kept apart from `ds_comm.config` so that importing ds_comm (and every package above it) does not
import pydantic, which alone costs ~0.3 s; the pydantic models load the first time a config is read.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["AUTO", "Auto", "ConfigDeprecationWarning", "ConfigError"]

#: The literal DeepSpeed users write where a caller (HF Trainer, Accelerate) fills the value in.
AUTO = "auto"
Auto = Literal["auto"]


class ConfigError(ValueError):
    """A config value a user wrote is wrong; the message names the key path, the value and the fix."""


class ConfigDeprecationWarning(FutureWarning):
    """A deprecated config key was used; it still works and maps to its replacement."""
