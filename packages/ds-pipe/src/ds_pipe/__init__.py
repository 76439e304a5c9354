"""ds-pipe: Pipeline parallelism: topology, PipelineModule, 1F1B schedules, p2p, executor."""

from __future__ import annotations

from ds_pipe.__about__ import __version__

__all__ = ["__version__"]
