"""`deepspeed.utils.timer`: `trim_mean`, the outlier-robust average DeepSpeed reports timings with.

It is ds-comm's (`ds_comm.trim_mean`), which the comms logger's summaries use. The engine's own timers
(`wall_clock_breakdown`, throughput) are `ds_engine._report.timers`; only this helper of DeepSpeed's timer
module is part of the surface scripts import.
"""

from __future__ import annotations

from ds_comm import trim_mean

__all__ = ["trim_mean"]
