"""Hang every ds package's root logger under DeepSpeed's "DeepSpeed" logger (see `_report.logging`'s note).

Its own module, importing nothing but `logging`, because `import ds_engine` must do this and stay cheap:
the rest of `_report.logging` (ds-comm, the config's level names) loads on first use.
"""

from __future__ import annotations

import logging

__all__ = ["DS_LOGGERS", "adopt_ds_loggers"]

#: The loggers DeepSpeed's single logger stands for here: itself, the shared `ds` one and each package's root.
DS_LOGGERS = ("DeepSpeed", "ds", "ds_comm", "ds_ops", "ds_zero", "ds_pipe", "ds_engine", "ds_parallel", "ds_launcher")


def adopt_ds_loggers() -> None:
    """Make "DeepSpeed" the parent of each ds package's root logger; idempotent.

    Only those roots are re-pointed: their children (`ds_zero._stage3.optimizer`, ...) keep their package
    root as parent, and loggers created later find it by name as usual.
    """
    parent = logging.getLogger(DS_LOGGERS[0])
    for name in DS_LOGGERS[1:]:
        logging.getLogger(name).parent = parent
