"""`deepspeed.runtime.activation_checkpointing.checkpointing`: the same as `ds_engine.checkpointing` (ds-pipe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_pipe's own
    from ds_pipe.checkpointing import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.activation_checkpointing.checkpointing",
    "ds_pipe.checkpointing",
    extra="pipe",
    feature="ds_engine.runtime.activation_checkpointing.checkpointing (activation checkpointing)",
)
