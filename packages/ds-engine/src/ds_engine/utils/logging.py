"""`deepspeed.utils.logging`: `logger` (the `ds` logger the ds packages share), `log_dist`, and the level setters.

Lightning sets the DeepSpeed log level through this path (`deepspeed.utils.logging.logger.setLevel`).
The library adds no handlers to `logger`. The ds packages log under their own names (`ds_zero.*`,
`ds_engine.*`, ...), so `set_log_level_from_string` (what the config's `log_level` does at
`initialize()`) sets all of them.
"""

from __future__ import annotations

import logging

from ds_comm import log_dist

__all__ = ["DS_LOGGERS", "get_log_level_from_string", "log_dist", "logger", "set_log_level_from_string"]

logger = logging.getLogger("ds")

#: The loggers DeepSpeed's single logger stands for here: the shared one and each package's root.
DS_LOGGERS = ("ds", "ds_comm", "ds_ops", "ds_zero", "ds_pipe", "ds_engine", "ds_parallel", "ds_launcher")

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def get_log_level_from_string(log_level_str: str) -> int:
    """`"info"` -> `logging.INFO` (any case).

    Raises:
        ValueError: not one of debug, info, warning, error, critical.
    """
    level = _LEVELS.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r} is not one of {', '.join(_LEVELS)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level of `custom_logger` (default: every ds package's logger) and of its handlers."""
    level = get_log_level_from_string(log_level_str)
    targets = [custom_logger] if custom_logger is not None else [logging.getLogger(n) for n in DS_LOGGERS]
    for target in targets:
        target.setLevel(level)
        for handler in target.handlers:
            handler.setLevel(level)
