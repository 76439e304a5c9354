"""Byte counts as people read them, shared by the comms logger's tables and `ds_bench`."""

from __future__ import annotations


def format_bytes(size: int) -> str:
    """`1536` -> `1.5 KB` (powers of 1024)."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GB"
