"""DeepCompile for stage 3: collectives as custom ops, FX passes that schedule them, a torch.compile backend."""

from __future__ import annotations

from ds_zero._compile.backend import DeepCompileBackend, Schedule
from ds_zero._compile.ops import GatherStats, stats

__all__ = ["DeepCompileBackend", "GatherStats", "Schedule", "stats"]
