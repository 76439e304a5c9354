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
    """Samples/sec of training, measured as DeepSpeed's `engine.tput_timer` measures it (same attributes).

    The engine calls `start()` at every forward and `stop(global_step=...)` at every `step()`, so each
    micro step is timed from its forward to its `step()`; the durations of a gradient-accumulation
    window add up to `step_elapsed_time`, which at the boundary gives that step's rate
    (`last_samples_per_sec`, `batch_size` samples) and goes back to 0. The first `start_step` optimizer
    steps (warm-up, allocation) are not timed: `start_time` stays 0 until `global_step_count` reaches
    `start_step`. `total_elapsed_time` sums every timed duration; `avg_samples_per_sec()` divides the
    samples of the timed steps by it. A disabled timer (`timers.throughput.enabled: false`) does nothing.

    Args:
        synchronize: waits for queued device work before reading the clock (None: `timers.throughput.synchronized`
            is off).
        batch_size: samples per optimizer step (the global train batch size).
        enabled: `timers.throughput.enabled`.
        start_step: optimizer steps left out before timing starts.
    """

    def __init__(
        self,
        synchronize: Callable[[], None] | None,
        batch_size: int,
        *,
        enabled: bool = True,
        start_step: int = 2,
    ) -> None:
        self._sync = synchronize
        self.enabled = enabled
        self.batch_size = batch_size
        self.start_step = start_step
        self.initialized = False
        self.started = False
        self.start_time = 0.0
        self.end_time = 0.0
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.last_samples_per_sec: float | None = None

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.time()

    def update_epoch_count(self) -> None:
        """A new epoch: count it and restart the micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """A micro step begins (its forward); the clock is read once warm-up is over."""
        if not self.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """The micro step ends (`engine.step()`); `global_step`: it was an optimizer step.

        `report_speed` is accepted for DeepSpeed's signature; the progress line is the engine's reporter's.
        """
        del report_speed
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = self._now()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.last_samples_per_sec = self.batch_size / max(self.step_elapsed_time, 1e-9)
                self.step_elapsed_time = 0

    def avg_samples_per_sec(self) -> float:
        """Samples/sec over the timed optimizer steps (`-inf` before any was timed, as in DeepSpeed)."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size * timed_steps / self.total_elapsed_time
