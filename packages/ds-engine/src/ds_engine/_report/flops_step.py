"""The `flops_profiler` section at run time: profile one optimizer step of the engine on rank 0.

As in DeepSpeed, the profile covers the step whose `global_steps` (counted before the step) equals
`profile_step`; every forward of that step restarts the profile, so with gradient accumulation it
describes the last micro-batch. Unlike DeepSpeed, the backward is counted too (its flops measured,
not estimated), and the forward, backward and step latencies are timed here rather than read from
the wall-clock timers, so `wall_clock_breakdown` is not needed. The table is printed (or written to
`output_file`) after that step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ds_comm import get_accelerator

if TYPE_CHECKING:
    from ds_engine._report.flops_profiler.profiler import FlopsProfiler
    from ds_engine.config._sections import FlopsProfilerConfig

logger = logging.getLogger(__name__)

__all__ = ["StepFlopsProfile"]


class StepFlopsProfile:
    """Drives a `FlopsProfiler` from the engine's forward, backward and step.

    Args:
        module: the wrapped model.
        engine: the engine (for the summary's batch and parallel sizes).
        config: the `flops_profiler` section.
        on_profiled: called with the profiler after the profiled step instead of printing the table
            (an autotuning experiment takes the flops from it).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        engine: Any,
        config: FlopsProfilerConfig,
        on_profiled: Callable[[FlopsProfiler], None] | None = None,
    ) -> None:
        from ds_engine._report.flops_profiler.profiler import FlopsProfiler

        self.on_profiled = on_profiled
        self.profiler: FlopsProfiler = FlopsProfiler(module, engine, config.recompute_fwd_factor)
        self.profile_step = config.profile_step
        self.module_depth = config.module_depth
        self.top_modules = config.top_modules
        self.detailed = config.detailed
        self.output_file = config.output_file

    @staticmethod
    def _now() -> float:
        get_accelerator().synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def forward(self, step: int) -> Iterator[None]:
        if step != self.profile_step:
            yield
            return
        self.profiler.start_profile()
        start = self._now()
        try:
            yield
        finally:
            self.profiler.latencies["fwd"] = self._now() - start
            self.profiler.pause()

    @contextlib.contextmanager
    def backward(self, step: int) -> Iterator[None]:
        if step != self.profile_step or not self.profiler.started:
            yield
            return
        start = self._now()
        try:
            with self.profiler.count_backward():
                yield
        finally:
            lat = self.profiler.latencies
            lat["bwd"] = lat.get("bwd", 0.0) + self._now() - start

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step != self.profile_step or not self.profiler.started:
            yield
            return
        start = self._now()
        yield
        self.profiler.latencies["step"] = self._now() - start
        if self.on_profiled is not None:
            self.on_profiled(self.profiler)
            self.profiler.end_profile()
            return
        self.profiler.print_model_profile(
            profile_step=step,
            module_depth=self.module_depth,
            top_modules=self.top_modules,
            detailed=self.detailed,
            output_file=self.output_file,
        )
        if self.output_file:
            logger.info("flops profile of step %d written to %s", step, self.output_file)
        self.profiler.end_profile()
