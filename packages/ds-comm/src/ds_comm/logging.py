"""Rank-aware logging helpers. The library never adds handlers; launchers and CLIs configure logging."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch.distributed as dist

__all__ = ["get_logger", "log_dist", "logger"]

logger = logging.getLogger("ds")


def get_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)`; here so packages have one place to change naming later."""
    return logging.getLogger(name)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_dist(
    message: str, ranks: Iterable[int] | None = (0,), level: int = logging.INFO, log: logging.Logger | None = None
) -> None:
    """Log `message` on the listed ranks only, prefixed with the rank.

    Args:
        message: the text.
        ranks: ranks that log; None or a list containing -1 means every rank. Default rank 0.
        level: a `logging` level.
        log: the logger to use (default: the `ds` logger).
    """
    rank = _rank()
    selected = ranks is None or any(r in (-1, rank) for r in ranks)
    if selected:
        (log or logger).log(level, "[Rank %d] %s", rank, message)
