"""`deepspeed.runtime.pipe`: ds-pipe's API (also `.topology`, `.schedule`, `.module` as DeepSpeed lays it out).

Needs the `pipe` extra: without ds-pipe, importing this package raises ImportError naming
`pip install 'ds-engine[pipe]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_pipe's own
    from ds_pipe import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.pipe",
    "ds_pipe",
    extra="pipe",
    feature="ds_engine.runtime.pipe (deepspeed.runtime.pipe, pipeline parallelism)",
)
