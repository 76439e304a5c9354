"""A tiny text progress bar for long consolidations (no dependency; stderr; redrawn at most 10 times a second)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """`label [########------]  57%  12.1M/21.2M` on one line, redrawn in place.

    Args:
        total: units of work (e.g. elements).
        label: text before the bar.
        stream: where to draw (default stderr).
        enabled: False makes every call a no-op.
        width: characters of the bar.
    """

    def __init__(
        self, total: int, *, label: str = "", stream: TextIO | None = None, enabled: bool = True, width: int = 30
    ) -> None:
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self._last_draw = 0.0

    def update(self, amount: int) -> None:
        """Record `amount` more units of work done."""
        self.done = min(self.done + int(amount), self.total) if self.total else self.done + int(amount)
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done >= self.total):
            self._draw()
            self._last_draw = now

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    def render(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        return f"{self.label} [{bar}] {frac * 100:5.1f}%  {_human(self.done)}/{_human(self.total)}"

    def _draw(self) -> None:
        self.stream.write("\r" + self.render())
        self.stream.flush()


def _human(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
