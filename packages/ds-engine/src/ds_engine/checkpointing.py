"""`deepspeed.checkpointing` for migrated scripts: activation checkpointing (`configure`, `checkpoint`...) from ds-pipe.

Needs the `pipe` extra: without ds-pipe, importing this module raises ImportError naming
`pip install 'ds-engine[pipe]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_pipe's own
    from ds_pipe.checkpointing import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.checkpointing",
    "ds_pipe.checkpointing",
    extra="pipe",
    feature="ds_engine.checkpointing (deepspeed.checkpointing, activation checkpointing)",
)
