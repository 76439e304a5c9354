"""`deepspeed.profiling.flops_profiler`: per-module params, MACs, flops and latency of a model's forward."""

from __future__ import annotations

from ds_engine._report.flops_profiler.profiler import (
    FlopsProfiler,
    get_model_profile,
    get_module_duration,
    get_module_flops,
    get_module_macs,
)
from ds_engine._report.flops_profiler.units import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "get_module_duration",
    "get_module_flops",
    "get_module_macs",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
