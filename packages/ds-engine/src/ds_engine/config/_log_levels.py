"""The level names a ds_config's `log_level` and `set_log_level_from_string` take, shared by both.

The config validates the name at load time and keeps it as written (DeepSpeed hands `"ERROR"` back
from `engine.log_level()`); the logging helpers turn it into a `logging` level when it is applied.
"""

from __future__ import annotations

import logging

__all__ = ["LOG_LEVELS", "log_level_value"]

#: Lower-case name -> `logging` level; names match in any case.
LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def log_level_value(name: str) -> int:
    """`"info"` / `"INFO"` -> `logging.INFO`.

    Raises:
        ValueError: `name` is not one of debug, info, warning, error, critical (any case).
    """
    level = LOG_LEVELS.get(name.lower()) if isinstance(name, str) else None
    if level is None:
        raise ValueError(f"log level {name!r} is not one of {', '.join(LOG_LEVELS)}")
    return level
