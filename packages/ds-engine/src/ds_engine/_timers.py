"""Wall-clock timers for `wall_clock_breakdown` and the samples/sec throughput timer.

The engine holds either `WallClockTimers` or `NullTimers` (same methods, no work), chosen once at
initialize(); the step path never asks whether timing is on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["NullTimers", "ThroughputTimer", "WallClockTimers"]

#: Phases the engine times, in log order.
PHASES = ("forward", "backward", "backward_inner", "allreduce", "step")


class WallClockTimers:
    """Accumulating named timers; `synchronize` runs before each clock read (device-accurate on GPUs).

    Args:
        synchronize: waits for queued device work (the accelerator's `synchronize`).
    """

    enabled = True

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._sync = synchronize
        self._started: dict[str, float] = {}
        self._total_s: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def start(self, name: str) -> None:
        self._sync()
        self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self._sync()
        began = self._started.pop(name, None)
        if began is None:
            return
        self._total_s[name] = self._total_s.get(name, 0.0) + time.perf_counter() - began
        self._count[name] = self._count.get(name, 0) + 1

    def snapshot(self) -> dict[str, float]:
        """Milliseconds accumulated per timer since the last `reset()`."""
        return {name: total * 1e3 for name, total in self._total_s.items()}

    def reset(self) -> None:
        self._total_s.clear()
        self._count.clear()

    def log_line(self, names: Iterable[str] = PHASES, normalizer: float = 1.0) -> str:
        """`"forward: 12.31 | backward: 25.02 | ..."` in ms per optimizer step (divided by `normalizer`)."""
        shown = [f"{n}: {self._total_s[n] * 1e3 / normalizer:.2f}" for n in names if n in self._total_s]
        return "time (ms) | " + " | ".join(shown)


class NullTimers:
    """The timers interface doing nothing (`wall_clock_breakdown: false`)."""

    enabled = False

    def start(self, name: str) -> None:
        return None

    def stop(self, name: str) -> None:
        return None

    def snapshot(self) -> dict[str, float]:
        return {}

    def reset(self) -> None:
        return None

    def log_line(self, names: Iterable[str] = PHASES, normalizer: float = 1.0) -> str:
        return ""


class ThroughputTimer:
    """Samples/sec between optimizer steps; the first step (warm-up, allocation) is left out of the average.

    Args:
        synchronize: waits for queued device work before reading the clock (`timers.throughput.synchronized`).
    """

    def __init__(self, synchronize: Callable[[], None] | None) -> None:
        self._sync = synchronize
        self._last: float | None = None
        self._total_s = 0.0
        self._total_samples = 0
        self.last_samples_per_sec: float | None = None

    def boundary(self, samples: int) -> float | None:
        """Record an optimizer step that processed `samples`; returns this step's samples/sec (None for the first)."""
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        rate = None
        if self._last is not None:
            elapsed = max(now - self._last, 1e-9)
            rate = samples / elapsed
            self._total_s += elapsed
            self._total_samples += samples
        self._last = now
        self.last_samples_per_sec = rate
        return rate

    @property
    def avg_samples_per_sec(self) -> float | None:
        return self._total_samples / self._total_s if self._total_s > 0 else None
