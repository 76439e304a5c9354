"""`deepspeed.profiling`: the flops profiler (`profiling.flops_profiler`)."""

from __future__ import annotations
