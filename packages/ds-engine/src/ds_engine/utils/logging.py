"""`deepspeed.utils.logging`: `logger` (the `ds` logger the ds packages share) and `log_dist`.

Lightning sets the DeepSpeed log level through this path (`deepspeed.utils.logging.logger.setLevel`).
The library adds no handlers to `logger`.
"""

from __future__ import annotations

import logging

from ds_comm import log_dist

__all__ = ["log_dist", "logger"]

logger = logging.getLogger("ds")
