"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: ds-parallel's ALST for Hugging Face models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.ulysses_sp import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.sequence_parallel.ulysses_sp",
    "ds_parallel.ulysses_sp",
    extra="parallel",
    feature="ds_engine.runtime.sequence_parallel.ulysses_sp (ALST sequence parallelism)",
)
