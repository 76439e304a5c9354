"""`deepspeed.utils.logging`: `logger` (DeepSpeed's "DeepSpeed" logger), `log_dist`, and the level setters.

[Note: the "DeepSpeed" logger] DeepSpeed logs through `logging.getLogger("DeepSpeed")`, and users and
libraries configure that name: its level (Lightning through `deepspeed.utils.logging.logger.setLevel`, the
config's `log_level`), its handlers, its `propagate` flag (tests flip it so `caplog` sees the records).
The ds packages log under their own names (`ds`, `ds_zero.*`, `ds_engine.*`, ...). Importing this module
(every `import deepspeed` and `import ds_engine` does) makes the "DeepSpeed" logger the parent of each ds
package's root logger (`DS_LOGGERS`), so ds records travel the way DeepSpeed's do:

* a ds logger left at NOTSET (the default) takes its effective level from "DeepSpeed", so setting that
  logger to WARNING hides ds INFO records and setting it to INFO lets them through;
* records propagate from the ds loggers to the handlers of "DeepSpeed", and past it only if its
  `propagate` is true (the default, so root handlers and `caplog` see them as before).

The library still adds no handler and sets no level or `propagate` here: while nobody configures
"DeepSpeed", it passes everything through unchanged (root's level, root's handlers, Python's last-resort
handler), so a record is printed once, as before. A handler a user puts on "DeepSpeed" with
`propagate = False` (DeepSpeed's own setup) sees every ds record, and root's handlers then see none.
"""

from __future__ import annotations

import logging

from ds_comm import log_dist
from ds_engine._report.logger_tree import DS_LOGGERS, adopt_ds_loggers
from ds_engine.config._log_levels import log_level_value

__all__ = ["DS_LOGGERS", "get_log_level_from_string", "log_dist", "logger", "set_log_level_from_string"]

logger = logging.getLogger("DeepSpeed")

adopt_ds_loggers()


def get_log_level_from_string(log_level_str: str) -> int:
    """`"info"` -> `logging.INFO` (any case).

    Raises:
        ValueError: not one of debug, info, warning, error, critical.
    """
    return log_level_value(log_level_str)


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set the level of `custom_logger` (default: the "DeepSpeed" logger and every ds package's) and of its handlers."""
    level = get_log_level_from_string(log_level_str)
    targets = [custom_logger] if custom_logger is not None else [logging.getLogger(n) for n in DS_LOGGERS]
    for target in targets:
        target.setLevel(level)
        for handler in target.handlers:
            handler.setLevel(level)
