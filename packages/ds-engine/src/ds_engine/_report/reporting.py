"""After each optimizer step: the `steps_per_print` progress line, timer logs, and monitor events."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from ds_comm import get_accelerator, log_dist
from ds_engine._report.monitors import Event, MonitorMaster
from ds_engine._report.timers import PHASES, NullTimers, ThroughputTimer, WallClockTimers

logger = logging.getLogger(__name__)

__all__ = ["StepReporter"]


class StepReporter:
    """Everything the engine reports after a step, decided at initialize().

    Args:
        steps_per_print: progress-line interval in optimizer steps (None: never).
        timers: the wall-clock timers (logged and reset at each progress line).
        throughput: the samples/sec timer (the engine starts and stops it; a disabled one reports nothing).
        monitor: the monitor, or None.
        memory_breakdown: add device memory to the progress line.
    """

    def __init__(
        self,
        *,
        steps_per_print: int | None,
        timers: WallClockTimers | NullTimers,
        throughput: ThroughputTimer,
        monitor: MonitorMaster | None,
        memory_breakdown: bool,
    ) -> None:
        self.steps_per_print = steps_per_print
        self.timers = timers
        self.throughput = throughput
        self.monitor = monitor if monitor is not None and monitor.enabled else None
        self.memory_breakdown = memory_breakdown
        self.needs_loss = self.monitor is not None
        self._steps_since_print = 0

    def after_step(
        self,
        *,
        global_steps: int,
        global_samples: int,
        skipped_steps: int,
        lrs: Callable[[], list[float]],
        loss_scale: Callable[[], float],
        loss: torch.Tensor | None,
    ) -> None:
        """Called once per optimizer step, after the counters moved."""
        rate = self.throughput.last_samples_per_sec if self.throughput.enabled else None
        self.throughput.last_samples_per_sec = None  # each step's rate is reported once
        self._steps_since_print += 1
        if self.monitor is not None:
            events: list[Event] = [
                ("Train/Samples/lr", float(lrs()[0]), global_samples),
                ("Train/Samples/loss_scale", float(loss_scale()), global_samples),
            ]
            if loss is not None:
                events.append(("Train/Samples/train_loss", float(loss), global_samples))
            if rate is not None:
                events.append(("Train/Samples/samples_per_sec", rate, global_samples))
            self.monitor.write_events(events)
        if self.steps_per_print is None or global_steps % self.steps_per_print:
            return
        self._print(global_steps, skipped_steps, lrs(), loss_scale(), global_samples)

    def _print(self, step: int, skipped: int, lrs: list[float], loss_scale: float, global_samples: int) -> None:
        avg = self.throughput.avg_samples_per_sec()
        rate = f"{avg:.2f}" if math.isfinite(avg) else "n/a"
        line = f"step={step}, skipped={skipped}, lr={lrs}, loss_scale={loss_scale:g}, samples/sec={rate}"
        if self.memory_breakdown:
            stats = get_accelerator().memory_stats()
            line += (
                f", mem_allocated={stats['allocated_bytes'] / 2**30:.2f}GB, "
                f"max_allocated={stats['max_allocated_bytes'] / 2**30:.2f}GB"
            )
        log_dist(line, ranks=[0], log=logger)
        if self.timers.enabled:
            per_step = self._steps_since_print
            log_dist(self.timers.log_line(PHASES, normalizer=per_step), ranks=[0], log=logger)
            if self.monitor is not None:
                snap = self.timers.snapshot()
                self.monitor.write_events(
                    [
                        (f"Train/Samples/elapsed_time_ms_{name}", ms / per_step, global_samples)
                        for name, ms in snap.items()
                    ]
                )
            self.timers.reset()
        self._steps_since_print = 0
