"""`deepspeed.runtime.activation_checkpointing.checkpointing`: the same as `ds_engine.checkpointing` (ds-pipe)."""

from __future__ import annotations

from ds_engine._reexport import optional_reexport

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.activation_checkpointing.checkpointing", "ds_pipe.checkpointing", extra="pipe",
    feature="ds_engine.runtime.activation_checkpointing.checkpointing (activation checkpointing)")
