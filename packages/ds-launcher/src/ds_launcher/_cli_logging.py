"""Logging for the two command-line entry points (the library itself never adds handlers)."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_cli_logging(level: str, *, quiet: bool = False, name: str = "ds_launcher") -> None:
    """Send the launcher's records to stderr with a short prefix; `quiet` means errors only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{name}] %(levelname)s %(message)s"))
    root = logging.getLogger("ds_launcher")
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(logging.ERROR if quiet else getattr(logging, level.upper()))
