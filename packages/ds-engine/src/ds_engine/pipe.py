"""`deepspeed.pipe` for migrated scripts: `from ds_engine.pipe import PipelineModule, LayerSpec, TiedLayerSpec`.

Everything ds-pipe exports (topologies, schedules, `PipelineModule`...), looked up on ds-pipe itself.
Needs the `pipe` extra: without ds-pipe, importing this module raises ImportError naming
`pip install 'ds-engine[pipe]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_pipe's own
    from ds_pipe import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.pipe", "ds_pipe", extra="pipe", feature="ds_engine.pipe (deepspeed.pipe, pipeline parallelism)"
)
